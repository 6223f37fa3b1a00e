package testenv_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

func TestRedisSentinel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := testenv.RedisSentinel(t)
	if got, want := len(s.SentinelAddrs), 3; got != want {
		t.Fatalf("len(SentinelAddrs): got %d, want %d", got, want)
	}
	for i, sn := range s.Sentinels {
		if got, want := sn.Addr, s.SentinelAddrs[i]; got != want {
			t.Fatalf("Sentinels[%d].Addr: got %q, want %q", i, got, want)
		}
	}
	first, second := s.Master.Addr, s.Replica.Addr
	if first == second {
		t.Fatalf("Master and Replica share the address %s", first)
	}
	assertRoles(t, s)

	rdb := s.Client(t)
	key := testenv.Name(t)
	if err := rdb.Set(ctx, key, "before", 0).Err(); err != nil {
		t.Fatalf("SET through the failover client: %v", err)
	}
	// WAIT counts the replicas that have every write of its own connection,
	// so the write and the WAIT share a connection.
	conn := s.Master.Client(t).Conn()
	t.Cleanup(func() { _ = conn.Close() })
	if err := conn.Set(ctx, key+":marker", "1", 0).Err(); err != nil {
		t.Fatalf("SET on the master: %v", err)
	}
	if got, err := conn.Wait(ctx, 1, time.Second).Result(); err != nil || got != 1 {
		t.Fatalf("WAIT 1 1000: got %d replicas, %v; want 1", got, err)
	}

	s.Failover(t)
	if got, want := s.Master.Addr, second; got != want {
		t.Fatalf("Master.Addr after Failover: got %s, want the old replica %s", got, want)
	}
	if got, want := s.Replica.Addr, first; got != want {
		t.Fatalf("Replica.Addr after Failover: got %s, want the old master %s", got, want)
	}
	assertRoles(t, s)
	if got, err := rdb.Get(ctx, key).Result(); err != nil || got != "before" {
		t.Fatalf("GET %s after Failover: got %q, %v; want %q", key, got, err, "before")
	}
	if err := rdb.Set(ctx, key, "after", 0).Err(); err != nil {
		t.Fatalf("SET after Failover: %v", err)
	}
	// The old master is a read-only replica now.
	err := s.Replica.Client(t).Set(ctx, key, "stale", 0).Err()
	if err == nil || !strings.HasPrefix(err.Error(), "READONLY") {
		t.Fatalf("SET on the demoted master: got %v, want READONLY", err)
	}

	// And back again: Failover can be repeated.
	s.Failover(t)
	if got, want := s.Master.Addr, first; got != want {
		t.Fatalf("Master.Addr after the second Failover: got %s, want %s", got, want)
	}
	assertRoles(t, s)
	if got, err := rdb.Get(ctx, key).Result(); err != nil || got != "after" {
		t.Fatalf("GET %s after the second Failover: got %q, %v; want %q", key, got, err, "after")
	}
}

// assertRoles checks what the sentinels and the servers say against Master
// and Replica.
func assertRoles(t *testing.T, s *testenv.Sentinel) {
	t.Helper()
	ctx := context.Background()
	for _, addr := range s.SentinelAddrs {
		sc := redis.NewSentinelClient(&redis.Options{Addr: addr})
		got, err := sc.GetMasterAddrByName(ctx, s.MasterName).Result()
		_ = sc.Close()
		if err != nil {
			t.Fatalf("sentinel %s: GET-MASTER-ADDR-BY-NAME: %v", addr, err)
		}
		if got, want := net.JoinHostPort(got[0], got[1]), s.Master.Addr; got != want {
			t.Fatalf("sentinel %s: master at %s, want %s", addr, got, want)
		}
	}
	for srv, want := range map[*testenv.Server]string{s.Master: "role:master", s.Replica: "role:slave"} {
		info, err := srv.Client(t).Info(ctx, "replication").Result()
		if err != nil {
			t.Fatalf("INFO replication on %s: %v", srv.Addr, err)
		}
		if !strings.Contains(info, want+"\r\n") {
			t.Fatalf("INFO replication on %s: got\n%s\nwant %s", srv.Addr, info, want)
		}
	}
	if info, _ := s.Replica.Client(t).Info(ctx, "replication").Result(); !strings.Contains(info, "master_link_status:up") {
		t.Fatalf("INFO replication on replica %s: got\n%s\nwant master_link_status:up", s.Replica.Addr, info)
	}
}
