package testenv

import (
	"context"
	"encoding/json"
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

// Kill kills the node's Erlang VM with SIGKILL, like a crash or a power
// cut: nothing is flushed, its connections are reset, and the other nodes
// see it go down at once. Kill waits for the process to exit. Killing a
// killed node does nothing. It may be called from any goroutine.
func (n *RabbitNode) Kill() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.kill()
}

// kill kills the VM, if any, and waits for it. n.mu must be held.
func (n *RabbitNode) kill() {
	if n.proc != nil {
		n.proc.Kill()
		n.proc = nil
	}
}

// Start starts a killed node again with the same name, ports and Dir, and
// waits until rabbitmqctl cluster_status on it lists it and every other
// running node of the cluster as running. Starting a running node does
// nothing. If that takes more than 60 seconds, the test fails and the logs
// are printed.
func (n *RabbitNode) Start() {
	t := n.r.t
	t.Helper()
	start := time.Now()
	deadline := start.Add(rabbitNodeStartTimeout)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	if err := n.relaunch(deadline); err != nil {
		t.Fatalf("testenv: restarting RabbitMQ node %s: %v (the logs follow)", n.Name, err)
	}
	if err := n.r.waitRunning(ctx, n); err != nil {
		t.Fatalf("testenv: restarted RabbitMQ node %s not back in the cluster: %v (the logs follow)", n.Name, err)
	}
	t.Logf("testenv: RabbitMQ node %s restarted in %v", n.Name, time.Since(start).Round(time.Millisecond))
}

// relaunch launches a node that is not running on its ports, waiting while
// they are taken.
func (n *RabbitNode) relaunch(deadline time.Time) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc != nil {
		return nil
	}
	var prev error
	for {
		err := n.launch(deadline)
		if err != nil && prev != nil {
			err = fmt.Errorf("%w (after %v)", err, prev)
		}
		// While the node was down, the kernel may have handed one of its
		// ports to an outgoing connection; such ports are soon released.
		if err == nil || !errors.Is(err, errPortInUse) || time.Now().After(deadline) {
			return err
		}
		prev = err
		time.Sleep(100 * time.Millisecond)
	}
}

// Partition cuts the node off from the other nodes of the cluster: its
// Erlang distribution takes a cookie of its own and drops its connections
// to them, so that every connection between it and them, either way, is
// refused, as if the network between them were cut. Its own clients still
// reach its AMQP port; with pause_minority (see RabbitCluster) the node
// soon stops serving them and closes their connections. Heal ends the
// partition. The test fails if rabbitmqctl cannot run on the node.
//
// This is a partition of the Erlang distribution, made on loopback without
// packet filters; what it does not model is a link that drops packets
// silently (connections then time out rather than being refused).
func (n *RabbitNode) Partition() {
	t := n.r.t
	t.Helper()
	n.mu.Lock()
	n.cut = fmt.Sprintf("partitioned%08x", rand.Uint32())
	cut := n.cut
	n.mu.Unlock()
	expr := fmt.Sprintf("erlang:set_cookie(node(), '%s'), [erlang:disconnect_node(N) || N <- nodes()], ok.", cut)
	if out, err := n.Rabbitmqctl("eval", expr); err != nil {
		t.Fatalf("testenv: partitioning RabbitMQ node %s: %v %s", n.Name, err, out)
	}
}

// Heal ends a Partition: the node takes the cluster's cookie again and
// reconnects to the other nodes. It returns once rabbitmqctl
// cluster_status on the node lists every running node as running (with
// pause_minority the node resumes serving clients then), failing the test
// after 60 seconds.
func (n *RabbitNode) Heal() {
	t := n.r.t
	t.Helper()
	n.mu.Lock()
	cut := n.cut
	n.cut = ""
	n.mu.Unlock()
	if cut == "" {
		return
	}
	cookie, err := os.ReadFile(filepath.Join(n.r.dir, "home", ".erlang.cookie"))
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	var ping strings.Builder
	for _, o := range n.r.Nodes {
		if o != n {
			fmt.Fprintf(&ping, "net_adm:ping('%s'), ", o.Name)
		}
	}
	expr := fmt.Sprintf("erlang:set_cookie(node(), '%s'), %sok.", cookie, ping.String())
	start := time.Now()
	if out, err := n.Rabbitmqctl("--erlang-cookie", cut, "eval", expr); err != nil {
		t.Fatalf("testenv: healing RabbitMQ node %s: %v %s", n.Name, err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), rabbitNodeStartTimeout)
	defer cancel()
	if err := n.r.waitRunning(ctx, n); err != nil {
		t.Fatalf("testenv: RabbitMQ node %s not back in the cluster after the partition: %v", n.Name, err)
	}
	t.Logf("testenv: RabbitMQ node %s rejoined in %v after the partition", n.Name, time.Since(start).Round(time.Millisecond))
}

// Pid returns the process id of the node's Erlang VM, or 0 if the node is
// killed.
func (n *RabbitNode) Pid() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc == nil {
		return 0
	}
	return n.proc.Pid()
}

// running reports whether the node's process runs.
func (n *RabbitNode) running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.proc != nil
}

// Rabbitmqctl runs rabbitmqctl -n <node> args with the cluster's cookie
// and epmd, for at most 30 seconds, and returns its standard output; the
// error includes its standard error. Each run starts an Erlang VM, which
// takes most of a second.
func (n *RabbitNode) Rabbitmqctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), rabbitCtlTimeout)
	defer cancel()
	return n.r.ctl(ctx, n, args...)
}

func (r *Rabbit) ctl(ctx context.Context, n *RabbitNode, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, r.ctlBin, append([]string{"-n", n.Name}, args...)...)
	cmd.Dir = r.dir
	cmd.Env = r.env
	cmd.SysProcAttr = sysProcAttr()
	cmd.WaitDelay = 5 * time.Second
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("rabbitmqctl -n %s %s: %w: %s",
			n.Name, quoteArgs(args), err, strings.TrimSpace(stderr.String()+"\n"+stdout.String()))
	}
	return stdout.String(), nil
}

// rabbitClusterStatus is the part of rabbitmqctl cluster_status
// --formatter json that testenv reads.
type rabbitClusterStatus struct {
	RunningNodes []string `json:"running_nodes"`
	DiskNodes    []string `json:"disk_nodes"`
}

func (r *Rabbit) clusterStatus(ctx context.Context, via *RabbitNode) (rabbitClusterStatus, error) {
	var st rabbitClusterStatus
	out, err := r.ctl(ctx, via, "--quiet", "cluster_status", "--formatter", "json")
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return st, fmt.Errorf("rabbitmqctl -n %s cluster_status: %v in %q", via.Name, err, out)
	}
	return st, nil
}

// waitRunning waits until cluster_status on via lists as running every
// node whose process runs, and as members all the cluster's nodes.
func (r *Rabbit) waitRunning(ctx context.Context, via *RabbitNode) error {
	return poll(ctx, rabbitCtlPollInterval, func() error {
		cctx, cancel := context.WithTimeout(ctx, rabbitCtlTimeout)
		defer cancel()
		st, err := r.clusterStatus(cctx, via)
		if err != nil {
			return err
		}
		for _, n := range r.Nodes {
			if !slices.Contains(st.DiskNodes, n.Name) {
				return fmt.Errorf("%s is not a member: cluster_status on %s lists %v", n.Name, via.Name, st.DiskNodes)
			}
			if n.running() && !slices.Contains(st.RunningNodes, n.Name) {
				return fmt.Errorf("%s is not running: cluster_status on %s lists %v as running", n.Name, via.Name, st.RunningNodes)
			}
		}
		return nil
	})
}

// live returns the first node whose process runs and that is not cut off
// by Partition, or nil.
func (r *Rabbit) live() *RabbitNode {
	for _, n := range r.Nodes {
		n.mu.Lock()
		ok := n.proc != nil && n.cut == ""
		n.mu.Unlock()
		if ok {
			return n
		}
	}
	return nil
}

// RunningNodes returns the names of the nodes that rabbitmqctl
// cluster_status, run on the first node still running, lists as running,
// sorted. The test fails if no node runs or rabbitmqctl fails.
func (r *Rabbit) RunningNodes() []string {
	r.t.Helper()
	via := r.live()
	if via == nil {
		r.t.Fatalf("testenv: no node of RabbitMQ cluster %s is running", r.Name)
	}
	ctx, cancel := context.WithTimeout(context.Background(), rabbitCtlTimeout)
	defer cancel()
	st, err := r.clusterStatus(ctx, via)
	if err != nil {
		r.t.Fatalf("testenv: %v", err)
	}
	slices.Sort(st.RunningNodes)
	return st.RunningNodes
}

// QueueLeader returns the node hosting the leader of the quorum queue (or
// the master of a classic queue) named queue in vhost "/", as
// rabbitmqctl list_queues on a running node reports it. It waits, for at
// most 30 seconds, until that node is one whose process runs, such as after
// the leader was killed and the others elected a new one. The test fails if
// there is none by then.
func (r *Rabbit) QueueLeader(queue string) *RabbitNode {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rabbitLeaderTimeout)
	defer cancel()
	var leader *RabbitNode
	err := poll(ctx, rabbitCtlPollInterval, func() error {
		via := r.live()
		if via == nil {
			return errors.New("no node is running")
		}
		cctx, cancel := context.WithTimeout(ctx, rabbitCtlTimeout)
		defer cancel()
		out, err := r.ctl(cctx, via, "--quiet", "list_queues", "-p", "/", "name", "leader", "--formatter", "json")
		if err != nil {
			return err
		}
		var queues []struct {
			Name   string `json:"name"`
			Leader string `json:"leader"`
		}
		if err := json.Unmarshal([]byte(out), &queues); err != nil {
			return fmt.Errorf("rabbitmqctl -n %s list_queues: %v in %q", via.Name, err, out)
		}
		for _, q := range queues {
			if q.Name != queue {
				continue
			}
			for _, n := range r.Nodes {
				if n.Name == q.Leader && n.running() {
					leader = n
					return nil
				}
			}
			return fmt.Errorf("queue %q: leader %q is not a running node", queue, q.Leader)
		}
		return fmt.Errorf("no queue %q on %s", queue, via.Name)
	})
	if err != nil {
		r.t.Fatalf("testenv: leader of queue %q in RabbitMQ cluster %s: %v", queue, r.Name, err)
	}
	return leader
}

// cleanup kills every node and then epmd, waiting for each, and prints the
// nodes' logs if the test failed.
func (r *Rabbit) cleanup() {
	var wg sync.WaitGroup
	for _, n := range r.Nodes {
		wg.Go(n.Kill)
	}
	wg.Wait()
	if r.epmd != nil {
		r.epmd.Kill()
	}
	if r.t.Failed() {
		for _, n := range r.Nodes {
			r.t.Logf("testenv: log of RabbitMQ node %s (%s), last %d bytes:\n%s",
				n.Name, n.logPath, rabbitLogTailBytes, LogTail(n.logPath, rabbitLogTailBytes))
		}
	}
}

// rabbitLookPath finds a program of RabbitMQ or Erlang, or ends the test
// with what to install. Debian's packages put a wrapper on PATH that runs
// the real script as the rabbitmq user and sends the server's output to
// /var/log/rabbitmq; the script beside the wrapper is used instead.
func rabbitLookPath(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		unavailable(t, "testenv: %s needs the %s program on PATH (%v).\n"+
			"It starts its own throwaway RabbitMQ cluster of three nodes on free loopback ports, "+
			"so it runs only on a host with RabbitMQ and Erlang installed: "+
			"the shared RabbitMQ of AMQP_URL, make services or docker compose cannot stand in for it.\n"+
			"Install RabbitMQ so that rabbitmq-server, rabbitmqctl and epmd are on PATH "+
			"(Debian/Ubuntu: apt-get install rabbitmq-server; macOS: brew install rabbitmq, "+
			"then add $(brew --prefix)/sbin to PATH).",
			t.Name(), name, err)
	}
	if target, err := filepath.EvalSymlinks(p); err == nil && filepath.Base(target) == "rabbitmq-script-wrapper" {
		if sib := filepath.Join(filepath.Dir(target), name); sib != target {
			if _, err := os.Stat(sib); err == nil {
				return sib
			}
		}
	}
	return p
}
