package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// A listing on a database without the table says to migrate it, and a
// cursor List did not give is refused.
func TestListNotMigratedAndBadCursor(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	bare := newStore(t, pool, pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1})
	if _, err := bare.List(ctx, lock.ListRequest{}); !errors.Is(err, pgstore.ErrNotMigrated) {
		t.Fatalf("List without a table: got %v, want ErrNotMigrated", err)
	}
	s := newStore(t, pool, schema(t, pool, pgstore.Config{CleanupInterval: -1}))
	for _, c := range []string{"zz", "0"} {
		if _, err := s.List(ctx, lock.ListRequest{Cursor: c}); !errors.Is(err, lock.ErrBadCursor) {
			t.Fatalf("List with cursor %q: got %v, want ErrBadCursor", c, err)
		}
	}
}
