package testenv

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"
)

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
