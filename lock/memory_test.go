package lock_test

import (
	"testing"

	"github.com/amqpidem/amqpidem/internal/storetest"
	"github.com/amqpidem/amqpidem/lock"
)

func TestMemoryStore(t *testing.T) {
	storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
		s, err := lock.NewMemoryStore(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}
