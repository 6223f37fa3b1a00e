package testenv

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

const (
	// rabbitNodeCount is how many nodes RabbitCluster starts.
	rabbitNodeCount = 3
	// rabbitHost is the host part of the node names. Erlang short names
	// need a host that resolves; localhost does everywhere, while the
	// machine's own hostname may resolve to a LAN address or not at all.
	rabbitHost = "localhost"
	// rabbitStartTimeout bounds starting the whole cluster until every
	// node runs in it. One node boots in about 6 s on two cores; the
	// second and third boot together.
	rabbitStartTimeout = 120 * time.Second
	// rabbitNodeStartTimeout bounds RabbitNode.Start until the node runs in
	// the cluster again.
	rabbitNodeStartTimeout = 60 * time.Second
	// rabbitCtlTimeout bounds one rabbitmqctl run.
	rabbitCtlTimeout = 30 * time.Second
	// rabbitLeaderTimeout bounds QueueLeader's wait for a leader on a
	// running node.
	rabbitLeaderTimeout = 30 * time.Second
	// rabbitPollInterval is how often an AMQP port is probed during boot.
	rabbitPollInterval = 100 * time.Millisecond
	// rabbitCtlPollInterval is how often rabbitmqctl is run while waiting:
	// each run starts an Erlang VM, about 0.7 s of CPU.
	rabbitCtlPollInterval = 500 * time.Millisecond
	// rabbitLogTailBytes is how much of a node's log a failure shows:
	// Erlang crash reports are long.
	rabbitLogTailBytes = 8 << 10
)

// Rabbit is a local RabbitMQ cluster of three nodes owned by one test,
// started by [RabbitCluster]. Its nodes and their epmd are killed and waited
// for in t.Cleanup, and the nodes' logs are printed if the test failed.
//
// Kill may be called from any goroutine; Start, RunningNodes and
// QueueLeader, like t.Fatalf, must be called from the goroutine running the
// test.
type Rabbit struct {
	// Name is the cluster's name (cluster_name), unique to this call, such
	// as "amqpidem-3f9c0a1e". The node names start with it.
	Name string
	// Nodes are the cluster's nodes: Nodes[0] ("a") first formed the
	// cluster, the others joined it.
	Nodes []*RabbitNode

	t        testing.TB
	dir      string
	ctlBin   string
	env      []string // environment of the nodes and of rabbitmqctl
	epmdPort int
	epmd     *Process
}

// RabbitNode is one node of a [Rabbit] cluster: an Erlang VM running
// RabbitMQ, a child process of the test binary.
type RabbitNode struct {
	// Name is the Erlang node name, such as
	// "amqpidem-3f9c0a1e-a@localhost", for rabbitmqctl -n.
	Name string
	// AMQPURL is amqp://guest:guest@127.0.0.1:port/, the node's AMQP
	// listener. It stays the same across Kill and Start. The guest user may
	// connect from loopback only, which is where it is.
	AMQPURL string
	// Dir holds the node's configuration (rabbitmq.conf), database
	// (mnesia/), pid file and log, node.log. It survives Kill and Start, so
	// the node comes back with its queues and messages.
	Dir string

	r         *Rabbit
	serverBin string
	conf      string // its rabbitmq.conf text but the listener line
	logPath   string
	pidPath   string
	amqpPort  int
	distPort  int

	mu   sync.Mutex
	cut  string   // the cookie of a Partition, until Heal
	proc *Process // the Erlang VM; nil while killed
}

// RabbitCluster starts a RabbitMQ cluster of three nodes from the
// rabbitmq-server and rabbitmqctl on PATH, for tests that kill and restart
// nodes under quorum queues or client connections. It returns once
// rabbitmqctl cluster_status on the first node lists all three running.
//
// Every node listens on 127.0.0.1 only: AMQP on a free port and Erlang
// distribution on another, both registered with an epmd of the cluster's
// own on a third free port (ERL_EPMD_PORT), so the cluster neither sees nor
// disturbs other Erlang nodes of the host such as a system RabbitMQ. Each
// node keeps its configuration, database and log in its Dir, under one
// t.TempDir(); it runs with no plugins (the management plugin is off), the
// default guest/guest user, a random Erlang cookie shared by the cluster
// and its rabbitmqctl runs (through HOME), and without reading
// /etc/rabbitmq. The first node starts alone; the two others then start
// together and join it at boot (classic_config peer discovery). That takes
// about 20 s on two cores.
//
// If rabbitmq-server, rabbitmqctl or epmd is not on PATH the test fails, or
// is skipped under -short without CI=true; if the cluster does not form
// within 120 seconds the test fails and the nodes' logs are printed.
func RabbitCluster(t testing.TB) *Rabbit {
	t.Helper()
	serverBin := rabbitLookPath(t, "rabbitmq-server")
	ctlBin := rabbitLookPath(t, "rabbitmqctl")
	epmdBin := rabbitLookPath(t, "epmd")
	start := time.Now()
	deadline := start.Add(rabbitStartTimeout)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()

	r := &Rabbit{
		Name:   fmt.Sprintf("amqpidem-%08x", rand.Uint32()),
		t:      t,
		dir:    t.TempDir(),
		ctlBin: ctlBin,
	}
	// Registered after t.TempDir, so it runs before the directory is removed.
	t.Cleanup(r.cleanup)

	if err := r.writeFiles(); err != nil {
		t.Fatalf("testenv: preparing a RabbitMQ cluster in %s: %v", r.dir, err)
	}
	if err := r.startEpmd(epmdBin, deadline); err != nil {
		t.Fatalf("testenv: starting epmd for a RabbitMQ cluster: %v", err)
	}
	r.env = r.baseEnv()

	for i := range rabbitNodeCount {
		letter := string(rune('a' + i))
		n := &RabbitNode{
			Name:      r.Name + "-" + letter + "@" + rabbitHost,
			Dir:       filepath.Join(r.dir, letter),
			r:         r,
			serverBin: serverBin,
		}
		n.logPath = filepath.Join(n.Dir, "node.log")
		n.pidPath = filepath.Join(n.Dir, "rabbitmq.pid")
		// pause_minority: a node cut off from the majority stops serving
		// clients (they reconnect elsewhere) until it is back, the
		// setting RabbitMQ recommends for clusters of three or more.
		n.conf = "cluster_name = " + r.Name + "\n" +
			"cluster_partition_handling = pause_minority\n"
		if i > 0 {
			// Used at the first boot only, while the database is empty;
			// later boots rejoin the cluster the database names.
			n.conf += "cluster_formation.peer_discovery_backend = classic_config\n" +
				"cluster_formation.classic_config.nodes.1 = " + r.Nodes[0].Name + "\n"
		}
		if err := os.Mkdir(n.Dir, 0o755); err != nil {
			t.Fatalf("testenv: %v", err)
		}
		r.Nodes = append(r.Nodes, n)
	}

	// The first node forms the cluster; the others find it at boot.
	if err := r.Nodes[0].launchFree(deadline); err != nil {
		t.Fatalf("testenv: starting RabbitMQ node %s: %v (the logs follow)", r.Nodes[0].Name, err)
	}
	errs := make([]error, rabbitNodeCount)
	var wg sync.WaitGroup
	for i, n := range r.Nodes[1:] {
		wg.Go(func() { errs[i+1] = n.launchFree(deadline) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("testenv: starting RabbitMQ node %s: %v (the logs follow)", r.Nodes[i].Name, err)
		}
	}
	if err := r.waitRunning(ctx, r.Nodes[0]); err != nil {
		t.Fatalf("testenv: RabbitMQ cluster %s did not form: %v (the logs follow)", r.Name, err)
	}
	t.Logf("testenv: RabbitMQ cluster %s of %d nodes started in %v", r.Name, rabbitNodeCount, time.Since(start).Round(time.Millisecond))
	return r
}

// writeFiles writes what the nodes share: the Erlang cookie in a home
// directory of their own, an enabled_plugins file enabling none, and an
// empty rabbitmq-env.conf standing in for /etc/rabbitmq's.
func (r *Rabbit) writeFiles() error {
	home := filepath.Join(r.dir, "home")
	if err := os.Mkdir(home, 0o700); err != nil {
		return err
	}
	cookie := make([]byte, 32)
	for i := range cookie {
		cookie[i] = byte('A' + rand.IntN(26))
	}
	if err := os.WriteFile(filepath.Join(home, ".erlang.cookie"), cookie, 0o400); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(r.dir, "enabled_plugins"), []byte("[].\n"), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(r.dir, "rabbitmq-env.conf"), nil, 0o644)
}

// baseEnv returns the environment shared by the nodes and rabbitmqctl: the
// test's, less whatever configures RabbitMQ or Erlang, plus the cluster's
// home (and so cookie), epmd port and files.
func (r *Rabbit) baseEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "RABBITMQ_") || strings.HasPrefix(k, "ERL_") ||
			k == "HOME" || k == "NOTIFY_SOCKET" {
			continue
		}
		env = append(env, kv)
	}
	return append(env,
		"HOME="+filepath.Join(r.dir, "home"),
		"ERL_EPMD_PORT="+strconv.Itoa(r.epmdPort),
		"RABBITMQ_CONF_ENV_FILE="+filepath.Join(r.dir, "rabbitmq-env.conf"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(r.dir, "enabled_plugins"),
		"RABBITMQ_USE_LONGNAME=false",
		// rabbitmqctl's own distribution listener: any free port rather
		// than the host-wide range 35672-35682.
		"RABBITMQ_CTL_DIST_PORT_MIN=0",
		"RABBITMQ_CTL_DIST_PORT_MAX=0",
	)
}

// startEpmd starts the cluster's own epmd on a free port of 127.0.0.1, its
// output in epmd.log.
func (r *Rabbit) startEpmd(bin string, deadline time.Time) error {
	var lastErr error
	for attempt := 1; attempt <= maxPortAttempts && time.Now().Before(deadline); attempt++ {
		port, err := freePort(false)
		if err != nil {
			return err
		}
		cmd := exec.Command(bin, "-port", strconv.Itoa(port), "-address", "127.0.0.1")
		cmd.Dir = r.dir
		p, err := StartProcess(cmd, filepath.Join(r.dir, "epmd.log"), "")
		if err != nil {
			return err
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		lastErr = poll(context.Background(), 20*time.Millisecond, func() error {
			select {
			case <-p.Exited():
				return errEpmdExited
			default:
			}
			if time.Now().After(deadline) {
				return context.DeadlineExceeded
			}
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err != nil {
				return err
			}
			return c.Close()
		})
		if lastErr == nil {
			r.epmd, r.epmdPort = p, port
			return nil
		}
		p.Kill()
		lastErr = fmt.Errorf("epmd on %s: %v: %s", addr, lastErr, strings.TrimSpace(p.Output()))
	}
	return lastErr
}

var errEpmdExited = errors.New("exited")

// launchFree starts the node on free AMQP and distribution ports, trying
// other ports while the chosen ones turn out to be taken.
func (n *RabbitNode) launchFree(deadline time.Time) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for attempt := 1; ; attempt++ {
		amqpPort, err := freePort(false)
		if err != nil {
			return err
		}
		distPort, err := freePort(false)
		if err != nil {
			return err
		}
		if distPort == amqpPort {
			continue
		}
		n.amqpPort, n.distPort = amqpPort, distPort
		n.AMQPURL = fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", amqpPort)
		err = n.launch(deadline)
		if err == nil || !errors.Is(err, errPortInUse) || attempt == maxPortAttempts || time.Now().After(deadline) {
			return err
		}
	}
}

// launch starts the node on its ports and waits, until deadline, for its
// AMQP listener to answer as a node of this cluster. n.mu must be held.
func (n *RabbitNode) launch(deadline time.Time) error {
	conf := fmt.Sprintf("listeners.tcp.1 = 127.0.0.1:%d\n", n.amqpPort) + n.conf
	if err := os.WriteFile(filepath.Join(n.Dir, "rabbitmq.conf"), []byte(conf), 0o644); err != nil {
		return err
	}
	_ = os.Remove(n.pidPath)
	cmd := exec.Command(n.serverBin)
	cmd.Dir = n.Dir
	cmd.Env = append(slices.Clip(n.r.env),
		"RABBITMQ_NODENAME="+n.Name,
		"RABBITMQ_DIST_PORT="+strconv.Itoa(n.distPort),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(n.Dir, "rabbitmq.conf"),
		"RABBITMQ_CONFIG_FILES="+filepath.Join(n.Dir, "conf.d"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(n.Dir, "advanced.config"),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(n.Dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(n.Dir, "log"),
		"RABBITMQ_LOGS=-", // to standard output, that is node.log
		"RABBITMQ_PID_FILE="+n.pidPath,
		"RABBITMQ_MOTD_FILE="+filepath.Join(n.Dir, "motd"),
		// With input allowed, rabbitmq-server execs erl, which execs the
		// VM: the process started here is beam.smp itself, so killing it
		// kills the node. -noinput then keeps the Erlang shell off.
		"RABBITMQ_ALLOW_INPUT=true",
		"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-noinput -kernel inet_dist_use_interface {127,0,0,1}",
	)
	p, err := StartProcess(cmd, n.logPath, fmt.Sprintf("%s as %s, AMQP on 127.0.0.1:%d, distribution on 127.0.0.1:%d",
		n.serverBin, n.Name, n.amqpPort, n.distPort))
	if err != nil {
		return err
	}
	n.proc = p

	tick := time.NewTicker(rabbitPollInterval)
	defer tick.Stop()
	for {
		if err := n.probe(); err == nil {
			return n.checkPid()
		}
		select {
		case <-p.Exited():
			n.proc = nil
			log := p.Output()
			if strings.Contains(log, "eaddrinuse") || strings.Contains(log, "could not bind to distribution port") {
				return fmt.Errorf("%w: rabbitmq-server %s (AMQP port %d, distribution port %d): %v",
					errPortInUse, n.Name, n.amqpPort, n.distPort, p.State())
			}
			return fmt.Errorf("rabbitmq-server %s exited: %v", n.Name, p.State())
		case <-tick.C:
		}
		if time.Now().After(deadline) {
			n.kill()
			return fmt.Errorf("rabbitmq-server %s did not accept AMQP connections on 127.0.0.1:%d in time", n.Name, n.amqpPort)
		}
	}
}

// probe opens and closes an AMQP connection to the node, and checks that
// the server answering is of this cluster (by its cluster_name), not a
// process that took the port.
func (n *RabbitNode) probe() error {
	conn, err := amqp.DialConfig(n.AMQPURL, amqp.Config{Dial: amqp.DefaultDial(time.Second)})
	if err != nil {
		return err
	}
	defer conn.Close()
	if got, _ := conn.Properties["cluster_name"].(string); got != n.r.Name {
		return fmt.Errorf("127.0.0.1:%d is RabbitMQ cluster %q, not %q", n.amqpPort, got, n.r.Name)
	}
	return nil
}

// checkPid checks that the node's Erlang VM, as its pid file names it, is
// the process launch started, which Kill kills. n.mu must be held.
func (n *RabbitNode) checkPid() error {
	b, err := os.ReadFile(n.pidPath)
	if err != nil {
		n.kill()
		return fmt.Errorf("rabbitmq-server %s: %v", n.Name, err)
	}
	started := n.proc.Pid()
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err == nil && pid == started {
		return nil
	}
	n.kill()
	if err == nil {
		// The VM lives in a process this package did not start, but the
		// pid file in the node's own directory names it as this node.
		if p, err := os.FindProcess(pid); err == nil {
			_ = p.Kill()
		}
	}
	return fmt.Errorf("rabbitmq-server %s: the Erlang VM is process %q (%s), not process %d that testenv started and can kill",
		n.Name, strings.TrimSpace(string(b)), n.pidPath, started)
}
