package pgstore_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrev12ShutdownRacesRun: Shutdown called while Run starts (6996e13
// returns before starting anything once stopping, but Shutdown may come
// just after that check, while the listener dials PostgreSQL and the
// cleanup waits for its first interval), many times at random moments.
// Each Shutdown must return nil with Run returned, and once all have,
// neither a goroutine of a relay nor a listening session of one may be
// left. Found nothing: kept as the check of that race.
func TestHrev12ShutdownRacesRun(t *testing.T) {
	r := newOutboxRig(t)
	pool, app := appPool(t, 4)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.write(true, r.msg("waiting"))
	time.Sleep(100 * time.Millisecond)
	before := hrev9Goroutines()
	const relays = 40
	for i := range relays {
		rl, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: testenv.AMQPURL(t), PollInterval: 10 * time.Millisecond,
			CleanupInterval: time.Millisecond, Retention: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- rl.Run(context.Background()) }()
		time.Sleep(time.Duration(rand.IntN(8000)) * time.Microsecond)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = rl.Shutdown(ctx)
		cancel()
		if err != nil {
			t.Errorf("relay %d: Shutdown: %v", i, err)
		}
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("relay %d: Run: %v", i, err)
			}
		case <-time.After(2 * time.Second):
			// Shutdown before Run's start returns at once; Run then
			// returns at once too.
			t.Errorf("relay %d: Run had not returned 2 s after Shutdown", i)
		}
	}
	if left := hrev9Settled(t, before, hrev9RelayGoroutines(before, hrev9Goroutines())); len(left) > 0 {
		t.Errorf("%d goroutines of the relays still run after their Shutdown:\n%s", len(left), strings.Join(left, "\n\n"))
	}
	if listening := hrev9Listening(t, r, app); listening != 0 {
		t.Errorf("%d listening sessions of the relays left after their Shutdown", listening)
	}
	t.Logf("published %d of the 1 row by the %d relays (0 or 1, as their Shutdowns came)", 1-r.count("p"), relays)
}
