package testenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

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
