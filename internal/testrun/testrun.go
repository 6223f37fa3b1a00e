// Package testrun runs amqpidem consumers for tests.
package testrun

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Consumer runs c until the test ends, then shuts it down within 10 s; it
// fails the test if Shutdown or Run does not end cleanly.
func Consumer(t testing.TB, c *amqpidem.Consumer) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := c.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
			t.Errorf("Run: got %v, want ErrConsumerClosed", err)
		}
	})
}
