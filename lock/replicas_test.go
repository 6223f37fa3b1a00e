package lock_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// With Config.Replicas, a write counts only once a replica acknowledged
// it: with the replica down, Acquire, Extend and Complete say the store is
// unavailable (the write is on the primary alone), and they work again,
// retried, once it is back.
func TestReplicasWaitsForReplication(t *testing.T) {
	sen := testenv.RedisSentinel(t)
	client := sen.Client(t)
	prefix := testenv.Name(t)
	s, err := lock.NewRedisStore(client, lock.Config{Prefix: prefix, Replicas: 1, ReplicaTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "pay-1", TTL: time.Minute})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire with the replica up: %v %v", res.Status, err)
	}
	if errs := s.Extend(ctx, res.Lease); errs[0] != nil {
		t.Fatalf("Extend with the replica up: %v", errs[0])
	}

	sen.Replica.Stop()
	start := time.Now()
	_, err = s.Acquire(ctx, lock.Request{Key: "pay-2", TTL: time.Minute})
	if !errors.Is(err, lock.ErrUnavailable) || !strings.Contains(err.Error(), "acknowledged by 0 of 1 replicas") {
		t.Fatalf("Acquire with the replica down: got %v, want ErrUnavailable saying no replica acknowledged", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Acquire with the replica down took %v", d)
	}
	if errs := s.Extend(ctx, res.Lease); !errors.Is(errs[0], lock.ErrUnavailable) {
		t.Fatalf("Extend with the replica down: got %v, want ErrUnavailable", errs[0])
	}
	if err := s.Complete(ctx, res.Lease, []byte("r")); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Complete with the replica down: got %v, want ErrUnavailable", err)
	}

	sen.Replica.Start()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err = s.Complete(ctx, res.Lease, []byte("r")) // a retry finds its own write
		if err == nil {
			break
		}
		if !errors.Is(err, lock.ErrUnavailable) || time.Now().After(deadline) {
			t.Fatalf("Complete once the replica is back: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The replica has the completed record as soon as Complete returned.
	replica, err := lock.NewRedisStore(sen.Replica.Client(t), lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if rec, err := replica.Inspect(ctx, "pay-1"); err != nil || rec.State != lock.StateCompleted {
		t.Fatalf("the replica's record: %+v %v, want completed", rec, err)
	}
}

func TestReplicasRefused(t *testing.T) {
	if _, err := lock.NewMemoryStore(lock.Config{Replicas: 1}); err == nil {
		t.Error("MemoryStore took Config.Replicas")
	}
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	defer cluster.Close()
	if _, err := lock.NewRedisStore(cluster, lock.Config{Replicas: 1}); err == nil {
		t.Error("NewRedisStore took Config.Replicas with a Cluster client")
	}
	if err := (lock.Config{Replicas: -1}).Validate(); err == nil {
		t.Error("Validate took Replicas -1")
	}
}
