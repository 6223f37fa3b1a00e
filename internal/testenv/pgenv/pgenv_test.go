package pgenv_test

import (
	"context"
	"testing"

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
)

func TestPool(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	var one int
	if err := pool.QueryRow(context.Background(), "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("SELECT 1: %d, %v", one, err)
	}
	if got := pgenv.DSN(t); got != pool.Config().ConnString() {
		t.Fatalf("DSN %q, the pool's %q", got, pool.Config().ConnString())
	}
}
