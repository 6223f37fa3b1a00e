package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestBackgroundCallsBoundedWhenDatabaseHangs is
// TestStoreCallsBoundedWhenDatabaseHangs for Cleanup and Count: the Store's
// own cleanup loop calls Cleanup with the Store's context, which has no
// deadline, so on a database that accepts connections and never answers
// it held a pooled connection, and stopped cleaning up, for good, with no
// log line; Count's statement_timeout is the server's, which a hung
// server never applies. Both return lock.ErrUnavailable within a bound.
func TestBackgroundCallsBoundedWhenDatabaseHangs(t *testing.T) {
	direct := pgenv.Pool(t, 4)
	cfg := schema(t, direct, pgstore.Config{CleanupInterval: -1})
	const bound = 15 * time.Second
	for _, call := range []struct {
		name string
		do   func(*pgstore.Store) error
	}{
		{"Cleanup", func(s *pgstore.Store) error { _, err := s.Cleanup(context.Background()); return err }},
		{"Count", func(s *pgstore.Store) error {
			_, err := s.Count(context.Background(), lock.CountRequest{})
			return err
		}},
	} {
		t.Run(call.name, func(t *testing.T) {
			store := newStore(t, blackHolePool(t, 4), cfg)
			done := make(chan error, 1)
			go func() { done <- call.do(store) }()
			select {
			case err := <-done:
				if !errors.Is(err, lock.ErrUnavailable) {
					t.Fatalf("%s on a database that does not answer: %v; want lock.ErrUnavailable", call.name, err)
				}
			case <-time.After(bound):
				t.Fatalf("%s(context.Background()) on a database that accepts connections and never answers "+
					"has not returned after %v; want lock.ErrUnavailable within callTimeout", call.name, bound)
			}
		})
	}
}
