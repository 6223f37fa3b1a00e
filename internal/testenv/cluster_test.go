package testenv_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

func TestRedisCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testenv.RedisCluster(t)
	if got, want := len(c.Addrs), 3; got != want {
		t.Fatalf("len(Addrs): got %d, want %d", got, want)
	}
	for i, n := range c.Nodes {
		if got, want := n.Addr, c.Addrs[i]; got != want {
			t.Fatalf("Nodes[%d].Addr: got %q, want %q", i, got, want)
		}
		info, err := n.Client(t).ClusterInfo(ctx).Result()
		if err != nil {
			t.Fatalf("CLUSTER INFO on %s: %v", n.Addr, err)
		}
		if !strings.Contains(info, "cluster_state:ok") {
			t.Fatalf("CLUSTER INFO on %s: got\n%s\nwant cluster_state:ok", n.Addr, info)
		}
	}

	cc := c.Client(t)
	prefix := testenv.Name(t)
	const n = 64
	slots := map[int64]bool{}
	for i := range n {
		key := fmt.Sprintf("%s:%d", prefix, i)
		if err := cc.Set(ctx, key, i, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", key, err)
		}
		slot, err := cc.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			t.Fatalf("CLUSTER KEYSLOT %s: %v", key, err)
		}
		slots[slot] = true
	}
	for i := range n {
		key := fmt.Sprintf("%s:%d", prefix, i)
		got, err := cc.Get(ctx, key).Int()
		if err != nil {
			t.Fatalf("GET %s: %v", key, err)
		}
		if got != i {
			t.Fatalf("GET %s: got %d, want %d", key, got, i)
		}
	}
	if got, min := len(slots), 2; got < min {
		t.Fatalf("keys landed on %d slots, want at least %d", got, min)
	}

	// Every master holds some of the keys: the slots are spread over all three.
	for _, node := range c.Nodes {
		size, err := node.Client(t).DBSize(ctx).Result()
		if err != nil {
			t.Fatalf("DBSIZE on %s: %v", node.Addr, err)
		}
		if size == 0 {
			t.Fatalf("DBSIZE on %s: got 0, want some of the %d keys", node.Addr, n)
		}
	}
}
