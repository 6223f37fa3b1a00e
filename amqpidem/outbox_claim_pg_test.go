package amqpidem_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestOutboxClaimRacePostgres is TestOutboxClaimRace on pgstore: two
// copies of each of 50 keys take the claim from one value at once, and
// each key's message is published once.
func TestOutboxClaimRacePostgres(t *testing.T) {
	pool := pgenv.Pool(t, 8)
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t))}
	if err := pgstore.Migrate(context.Background(), pool, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	s, err := pgstore.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	amqpidem.ClaimRace(t, s)
}
