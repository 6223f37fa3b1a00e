package testenv_test

import (
	"context"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

func TestRedisServerStopStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := testenv.RedisServer(t, "--maxmemory-policy", "allkeys-lru")
	rdb := s.Client(t)

	policy, err := rdb.ConfigGet(ctx, "maxmemory-policy").Result()
	if err != nil {
		t.Fatalf("CONFIG GET: %v", err)
	}
	if got, want := policy["maxmemory-policy"], "allkeys-lru"; got != want {
		t.Fatalf("maxmemory-policy: got %q, want %q", got, want)
	}
	if err := rdb.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}

	addr := s.Addr
	s.Stop()
	s.Stop() // idempotent
	if err := rdb.Ping(ctx).Err(); err == nil {
		t.Fatalf("PING after Stop: got nil error, want one")
	}

	s.Start()
	s.Start() // idempotent
	if got, want := s.Addr, addr; got != want {
		t.Fatalf("Addr after Start: got %q, want %q", got, want)
	}
	// The client reconnects, after the back-off go-redis keeps after failed dials.
	deadline := time.Now().Add(5 * time.Second)
	for err := rdb.Ping(ctx).Err(); err != nil; err = rdb.Ping(ctx).Err() {
		if time.Now().After(deadline) {
			t.Fatalf("PING after Start: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// No persistence by default: the restarted server is empty.
	if got, err := rdb.Exists(ctx, "k").Result(); err != nil || got != 0 {
		t.Fatalf("EXISTS k after restart: got %d, %v; want 0, nil", got, err)
	}
}

func TestRedisServerPersistsAcrossRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := testenv.RedisServer(t, "--appendonly", "yes", "--appendfsync", "always")
	rdb := s.Client(t)
	if err := rdb.Set(ctx, "k", "v", time.Hour).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	s.Stop()
	s.Start()
	got, err := rdb.Get(ctx, "k").Result()
	if err != nil {
		t.Fatalf("GET after restart: %v", err)
	}
	if want := "v"; got != want {
		t.Fatalf("GET after restart: got %q, want %q", got, want)
	}
}

func TestRedisServersAreIndependent(t *testing.T) {
	t.Parallel()
	a, b := testenv.RedisServer(t), testenv.RedisServer(t)
	if a.Addr == b.Addr || a.Dir == b.Dir {
		t.Fatalf("two servers share Addr or Dir: %q %q, %q %q", a.Addr, b.Addr, a.Dir, b.Dir)
	}
	a.Stop()
	if err := b.Client(t).Ping(context.Background()).Err(); err != nil {
		t.Fatalf("PING b after stopping a: %v", err)
	}
}
