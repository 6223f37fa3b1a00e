package testenv

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// sentinelMasterName is the name the sentinels monitor the master under.
	sentinelMasterName = "mymaster"
	// sentinelCount is how many sentinels watch the master.
	sentinelCount = 3
	// sentinelQuorum is how many sentinels must agree that the master is
	// down before an automatic failover.
	sentinelQuorum = 2
	// sentinelDownAfter is the sentinels' down-after-milliseconds.
	sentinelDownAfter = 1000
	// sentinelFailoverTimeout is the sentinels' failover-timeout, in
	// milliseconds.
	sentinelFailoverTimeout = 5000
	// sentinelStartTimeout bounds starting a Sentinel setup until the
	// sentinels see the master and its replica.
	sentinelStartTimeout = 30 * time.Second
	// failoverTimeout bounds Failover.
	failoverTimeout = 60 * time.Second
	// sentinelPollInterval is how often readiness is checked: each check
	// opens a dozen connections.
	sentinelPollInterval = 100 * time.Millisecond
)

// sentinelDebug shortens the sentinels' internal periods (SENTINEL DEBUG
// exists for tests). Redis refreshes INFO every 10 s and says hello every 2 s,
// and a sentinel waits four hello periods and one INFO refresh before it
// turns a demoted master into a replica: about 12 s per failover instead of
// about 2 s.
var sentinelDebug = []string{"SENTINEL", "DEBUG", "info-period", "1000", "publish-period", "500"}

// Sentinel is a Redis master with one replica, watched by three Redis
// Sentinels, all owned by one test and killed and waited for in t.Cleanup.
//
// Its methods, like t.Fatalf, must be called from the goroutine running the
// test; Failover changes Master and Replica.
type Sentinel struct {
	// MasterName is the name the sentinels monitor the master under, for
	// redis.FailoverOptions.MasterName and SENTINEL commands.
	MasterName string
	// SentinelAddrs are the sentinels' 127.0.0.1:port addresses.
	SentinelAddrs []string
	// Master is the server the sentinels report as the master, and Replica
	// the one replicating it. Failover swaps them; nothing else updates
	// them.
	//
	// Stopping the master is a crash: about a second later
	// (down-after-milliseconds 1000) the sentinels agree that it is down
	// and promote the replica by themselves, leaving Master and Replica
	// stale. Start restarts a server with the arguments it was first
	// started with (the replica with --replicaof the first master), and the
	// sentinels then reconfigure it as they would a restarted production
	// server.
	Master, Replica *Server
	// Sentinels are the sentinels' processes, in the order of SentinelAddrs.
	// Each keeps its state in sentinel.conf in its Dir, so Stop and Start
	// bring it back with what it knew.
	Sentinels []*Server

	mu      sync.Mutex
	clients []*redis.Client // made by Client and not yet cleaned up
}

// RedisSentinel starts, from the redis-server on PATH, a master, one replica
// of it (--replicaof) and three sentinels (redis-server sentinel.conf
// --sentinel) monitoring it as "mymaster" with quorum 2,
// down-after-milliseconds 1000, failover-timeout 5000 and resolve-hostnames
// no, every process on a free port of 127.0.0.1 in its own t.TempDir(). The
// sentinels run with SENTINEL DEBUG info-period 1000 publish-period 500 so
// that a failover finishes in seconds. The servers run as RedisServer's do,
// with --repl-diskless-sync-delay 0 so that a replica syncs at once.
//
// RedisSentinel returns once the replica is in sync (master_link_status:up)
// and every sentinel reports the master at its address, the replica in sync
// and the two other sentinels. If redis-server is not on PATH the test
// fails, or is skipped under -short without CI=true; if the setup is not
// ready within 30 seconds the test fails and the logs are printed.
func RedisSentinel(t testing.TB) *Sentinel {
	t.Helper()
	bin := lookPath(t, "redis-server")
	deadline := time.Now().Add(sentinelStartTimeout)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()

	s := &Sentinel{MasterName: sentinelMasterName}
	replArgs := []string{"--repl-diskless-sync-delay", "0"}
	s.Master = newServer(t, bin, replArgs)
	if err := s.Master.launchFree(false, deadline); err != nil {
		t.Fatalf("testenv: starting the Sentinel master: %v (its log follows)", err)
	}
	s.Replica = newServer(t, bin, append(slices.Clip(replArgs),
		"--replicaof", "127.0.0.1", strconv.Itoa(s.Master.port)))
	if err := s.Replica.launchFree(false, deadline); err != nil {
		t.Fatalf("testenv: starting the Sentinel replica: %v (its log follows)", err)
	}
	// Sentinels take the replica's state from INFO: let them find it in sync.
	if err := poll(ctx, 20*time.Millisecond, func() error { return replicating(s.Replica.Addr, s.Master.Addr) }); err != nil {
		t.Fatalf("testenv: replica %s of %s not in sync: %v", s.Replica.Addr, s.Master.Addr, err)
	}

	conf := fmt.Sprintf("sentinel resolve-hostnames no\n"+
		"sentinel monitor %[1]s 127.0.0.1 %[2]d %[3]d\n"+
		"sentinel down-after-milliseconds %[1]s %[4]d\n"+
		"sentinel failover-timeout %[1]s %[5]d\n",
		s.MasterName, s.Master.port, sentinelQuorum, sentinelDownAfter, sentinelFailoverTimeout)
	for range sentinelCount {
		sn := newServer(t, bin, []string{"--sentinel"})
		// The sentinel rewrites its config file with what it learns.
		sn.conf = filepath.Join(sn.Dir, "sentinel.conf")
		if err := os.WriteFile(sn.conf, []byte(conf), 0o644); err != nil {
			t.Fatalf("testenv: %v", err)
		}
		if err := sn.launchFree(false, deadline); err != nil {
			t.Fatalf("testenv: starting a sentinel: %v (its log follows)", err)
		}
		if _, err := command(sn.Addr, time.Second, sentinelDebug...); err != nil {
			t.Fatalf("testenv: %s on sentinel %s: %v", quoteArgs(sentinelDebug), sn.Addr, err)
		}
		s.Sentinels = append(s.Sentinels, sn)
		s.SentinelAddrs = append(s.SentinelAddrs, sn.Addr)
	}

	if err := poll(ctx, sentinelPollInterval, s.ready); err != nil {
		t.Fatalf("testenv: sentinels %v do not see master %s and replica %s: %v",
			s.SentinelAddrs, s.Master.Addr, s.Replica.Addr, err)
	}
	return s
}

// Client returns a failover client (redis.NewFailoverClient) of s's master,
// closed in t.Cleanup. It asks the sentinels for the master's address and
// follows failovers. Failover waits until every such client still open
// writes to the new master.
func (s *Sentinel) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := s.newClient()
	s.mu.Lock()
	s.clients = append(s.clients, c)
	s.mu.Unlock()
	t.Cleanup(func() {
		s.mu.Lock()
		s.clients = slices.DeleteFunc(s.clients, func(x *redis.Client) bool { return x == c })
		s.mu.Unlock()
		_ = c.Close()
	})
	return c
}

func (s *Sentinel) newClient() *redis.Client {
	return redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName: s.MasterName,
		// A copy: the client reorders and extends the slice it is given.
		SentinelAddrs: slices.Clone(s.SentinelAddrs),
	})
}

// Failover runs SENTINEL FAILOVER, promoting the replica, and swaps Master
// and Replica. It returns once every sentinel reports the new master and the
// old master as its replica in sync, and the clients made by Client (and a
// new one) write to the new master, both single commands and pipelines. It
// fails the test if that takes more than 60 seconds.
//
// Failover waits for the old master to be demoted, which the sentinels do
// about 2 s after the promotion: until then it is a second master, and
// writes sent to it by a client that has not yet heard of the failover are
// lost when it becomes a replica. That is Sentinel's documented behaviour,
// not a test artefact; Failover itself writes nothing until the old master
// is a replica, so the test sees the failover as its clients will once it
// has settled. Failover needs both servers and all three sentinels running.
func (s *Sentinel) Failover(t testing.TB) {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), failoverTimeout)
	defer cancel()

	if err := poll(ctx, sentinelPollInterval, s.startFailover); err != nil {
		t.Fatalf("testenv: SENTINEL FAILOVER %s: %v", s.MasterName, err)
	}
	old := s.Master
	s.Master, s.Replica = s.Replica, s.Master
	if err := poll(ctx, sentinelPollInterval, s.ready); err != nil {
		t.Fatalf("testenv: failover of %s from %s to %s not done: %v", s.MasterName, old.Addr, s.Master.Addr, err)
	}

	fresh := s.newClient()
	defer fresh.Close()
	s.mu.Lock()
	clients := append(slices.Clone(s.clients), fresh)
	s.mu.Unlock()
	for i, c := range clients {
		if err := poll(ctx, sentinelPollInterval, func() error { return s.probe(ctx, c) }); err != nil {
			t.Fatalf("testenv: after failover to %s, failover client %d of %d: %v", s.Master.Addr, i+1, len(clients), err)
		}
	}
	t.Logf("testenv: failover of %s from %s to %s took %v", s.MasterName, old.Addr, s.Master.Addr, time.Since(start).Round(time.Millisecond))
}

// startFailover asks the first sentinel that answers to fail over. It moves
// on to the next sentinel only if one does not answer at all: one that
// refuses (a failover in progress, no replica fit to promote yet) is asked
// again on the next call, so that two sentinels never start failovers at
// once.
func (s *Sentinel) startFailover() error {
	var errs []error
	for _, addr := range s.SentinelAddrs {
		_, err := command(addr, time.Second, "SENTINEL", "FAILOVER", s.MasterName)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("sentinel %s: %w", addr, err))
		if errors.As(err, new(replyError)) {
			break
		}
	}
	return errors.Join(errs...)
}

// ready reports whether Replica replicates Master in sync and every sentinel
// sees them so: nil, or what is not so yet.
func (s *Sentinel) ready() error {
	if err := replicating(s.Replica.Addr, s.Master.Addr); err != nil {
		return err
	}
	for _, addr := range s.SentinelAddrs {
		if err := sentinelSees(addr, s.MasterName, s.Master.Addr, s.Replica.Addr, len(s.SentinelAddrs)-1); err != nil {
			return fmt.Errorf("sentinel %s: %w", addr, err)
		}
	}
	return nil
}

// probe writes through c, with a single command and with a pipeline, and
// checks that the writes reached the master directly.
func (s *Sentinel) probe(ctx context.Context, c *redis.Client) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	key := fmt.Sprintf("testenv:failover-probe:%08x", rand.Uint32())
	if err := c.Set(ctx, key, "single", time.Minute).Err(); err != nil {
		return fmt.Errorf("SET: %w", err)
	}
	if _, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.Append(ctx, key, "+pipeline")
		return nil
	}); err != nil {
		return fmt.Errorf("pipelined APPEND: %w", err)
	}
	got, err := command(s.Master.Addr, time.Second, "GET", key)
	if err != nil {
		return fmt.Errorf("GET %s from master %s: %w", key, s.Master.Addr, err)
	}
	if want := "single+pipeline"; got != want {
		return fmt.Errorf("GET %s from master %s: got %q, want %q", key, s.Master.Addr, got, want)
	}
	return c.Del(ctx, key).Err()
}

// replicating reports whether the server at replica is a replica of the
// master at master, with its link up, and master a master.
func replicating(replica, master string) error {
	host, port, err := net.SplitHostPort(master)
	if err != nil {
		return err
	}
	info, err := command(replica, time.Second, "INFO", "replication")
	if err != nil {
		return fmt.Errorf("replica %s: INFO replication: %w", replica, err)
	}
	for field, want := range map[string]string{
		"role":               "slave",
		"master_host":        host,
		"master_port":        port,
		"master_link_status": "up",
	} {
		if got := infoField(info, field); got != want {
			return fmt.Errorf("replica %s: %s:%s, want %s", replica, field, got, want)
		}
	}
	info, err = command(master, time.Second, "INFO", "replication")
	if err != nil {
		return fmt.Errorf("master %s: INFO replication: %w", master, err)
	}
	if got, want := infoField(info, "role"), "master"; got != want {
		return fmt.Errorf("master %s: role:%s, want %s", master, got, want)
	}
	return nil
}

// sentinelSees reports whether the sentinel at addr reports master as the
// master called name, with no failover under way, replica as its one
// replica in sync, and others other sentinels.
func sentinelSees(addr, name, master, replica string, others int) error {
	reply, err := commandReply(addr, time.Second, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", name)
	if err != nil {
		return fmt.Errorf("GET-MASTER-ADDR-BY-NAME: %w", err)
	}
	hp, ok := reply.([]any)
	if !ok || len(hp) != 2 {
		return fmt.Errorf("GET-MASTER-ADDR-BY-NAME: unexpected reply %v", reply)
	}
	if got := net.JoinHostPort(fmt.Sprint(hp[0]), fmt.Sprint(hp[1])); got != master {
		return fmt.Errorf("master at %s, want %s", got, master)
	}

	reply, err = commandReply(addr, time.Second, "SENTINEL", "MASTER", name)
	if err != nil {
		return fmt.Errorf("SENTINEL MASTER: %w", err)
	}
	m := fields(reply)
	for field, want := range map[string]string{
		"flags":               "master",
		"num-slaves":          "1",
		"num-other-sentinels": strconv.Itoa(others),
	} {
		if got := m[field]; got != want {
			return fmt.Errorf("SENTINEL MASTER: %s %q, want %q", field, got, want)
		}
	}

	reply, err = commandReply(addr, time.Second, "SENTINEL", "REPLICAS", name)
	if err != nil {
		return fmt.Errorf("SENTINEL REPLICAS: %w", err)
	}
	replicas, _ := reply.([]any)
	if len(replicas) != 1 {
		return fmt.Errorf("SENTINEL REPLICAS: %d replicas, want 1", len(replicas))
	}
	r := fields(replicas[0])
	for field, want := range map[string]string{
		"name":               replica,
		"flags":              "slave",
		"master-link-status": "ok",
	} {
		if got := r[field]; got != want {
			return fmt.Errorf("SENTINEL REPLICAS: %s %q, want %q", field, got, want)
		}
	}
	return nil
}

// fields turns a flat field-value array, as SENTINEL MASTER and REPLICAS
// reply, into a map.
func fields(reply any) map[string]string {
	elems, _ := reply.([]any)
	m := make(map[string]string, len(elems)/2)
	for i := 0; i+1 < len(elems); i += 2 {
		k, _ := elems[i].(string)
		v, _ := elems[i+1].(string)
		m[k] = v
	}
	return m
}
