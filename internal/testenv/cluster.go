package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// clusterMasters is how many masters a Cluster has.
	clusterMasters = 3
	// clusterTimeout bounds starting a Cluster until every node reports it ok.
	clusterTimeout = 30 * time.Second
	// clusterSlots is how many hash slots Redis Cluster has.
	clusterSlots = 16384
)

// Cluster is a local Redis Cluster of three masters without replicas, owned
// by one test. Its nodes are killed and waited for in t.Cleanup.
type Cluster struct {
	// Addrs are the masters' 127.0.0.1:port addresses.
	Addrs []string
	// Nodes are the masters' processes, in the order of Addrs. Stopping one
	// takes its slots offline (the cluster reports cluster_state:fail after
	// the 5 s node timeout); starting it again brings it back with the same
	// slots, because its nodes.conf stays in its Dir.
	Nodes []*Server
}

// RedisCluster starts a Redis Cluster of three masters, no replicas, from the
// redis-server and redis-cli on PATH, and returns once every node reports
// cluster_state:ok with all 16384 slots covered. Each node runs with
// --cluster-enabled yes --save "" --appendonly no in its own t.TempDir(). If
// the binaries are missing the test fails, or is skipped under -short without
// CI=true; if the cluster is not ready within 30 seconds the test fails and
// the nodes' logs are printed.
func RedisCluster(t testing.TB) *Cluster {
	t.Helper()
	serverBin := lookPath(t, "redis-server")
	cliBin := lookPath(t, "redis-cli")
	deadline := time.Now().Add(clusterTimeout)

	c := &Cluster{}
	for range clusterMasters {
		s := newServer(t, serverBin, []string{
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "5000",
		})
		if err := s.launchFree(true, deadline); err != nil {
			t.Fatalf("testenv: starting Redis Cluster node: %v (its log follows)", err)
		}
		c.Nodes = append(c.Nodes, s)
		c.Addrs = append(c.Addrs, s.Addr)
	}

	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	create := exec.CommandContext(ctx, cliBin, args...)
	create.WaitDelay = time.Second
	out, err := create.CombinedOutput()
	logPath := filepath.Join(t.TempDir(), "cluster-create.log")
	_ = os.WriteFile(logPath, out, 0o644)
	if err != nil {
		t.Fatalf("testenv: %s %s: %v\n%s", cliBin, quoteArgs(args), err, out)
	}
	if err := waitClusterReady(ctx, c.Addrs); err != nil {
		t.Fatalf("testenv: Redis Cluster %v not ready: %v\n--- redis-cli output ---\n%s", c.Addrs, err, out)
	}
	return c
}

// Client returns a cluster client of c, closed in t.Cleanup.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs})
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// waitClusterReady polls until clusterReady holds or ctx ends.
func waitClusterReady(ctx context.Context, addrs []string) error {
	return poll(ctx, 50*time.Millisecond, func() error { return clusterReady(addrs) })
}

// clusterReady reports whether every node at addrs sees the whole cluster:
// state ok, all slots assigned and served, every node known and a master.
func clusterReady(addrs []string) error {
	want := map[string]string{
		"cluster_state":          "ok",
		"cluster_slots_assigned": strconv.Itoa(clusterSlots),
		"cluster_slots_ok":       strconv.Itoa(clusterSlots),
		"cluster_known_nodes":    strconv.Itoa(len(addrs)),
		"cluster_size":           strconv.Itoa(len(addrs)),
	}
	for _, addr := range addrs {
		info, err := command(addr, time.Second, "CLUSTER", "INFO")
		if err != nil {
			return fmt.Errorf("%s: CLUSTER INFO: %w", addr, err)
		}
		for field, v := range want {
			if got := infoField(info, field); got != v {
				return fmt.Errorf("%s: %s:%s, want %s", addr, field, got, v)
			}
		}
	}
	return nil
}
