//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
)

// rabbitmqctl runs rabbitmqctl with args, within a minute.
func rabbitmqctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("rabbitmqctl %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// ctl runs rabbitmqctl against the env's broker: the local one, or a
// running node of its cluster.
func (e *env) ctl(args ...string) (string, error) {
	if e.rabbit == nil {
		return rabbitmqctl(args...)
	}
	var out string
	err := errors.New("no node of the cluster runs")
	for _, n := range e.rabbit.Nodes {
		if n.Pid() == 0 {
			continue
		}
		if out, err = n.Rabbitmqctl(args...); err == nil {
			return out, nil
		}
	}
	return out, err
}

// listQueues returns, for every queue of the env (its name or prefixed by
// it and a dot), its messages (ready and unacknowledged) and, of those, the
// unacknowledged.
func (e *env) listQueues() (map[string][2]int, error) {
	out, err := e.ctl("list_queues", "-q", "--no-table-headers", "name", "messages", "messages_unacknowledged")
	if err != nil {
		return nil, err
	}
	depths := map[string][2]int{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Split(strings.TrimSpace(line), "\t")
		if len(f) != 3 || (f[0] != e.queue && !strings.HasPrefix(f[0], e.queue+".")) {
			continue
		}
		ready, err1 := strconv.Atoi(f[1])
		unacked, err2 := strconv.Atoi(f[2])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("list_queues: cannot parse %q", line)
		}
		depths[f[0]] = [2]int{ready, unacked}
	}
	return depths, nil
}

// connectionName finds the connection_name client property in a line of
// rabbitmqctl list_connections' table output.
var connectionName = regexp.MustCompile(`\{"connection_name","([^"]*)"\}`)

// closeConnections closes, server side, every connection whose
// connection_name starts with prefix, and returns how many it closed.
// Connections of anyone else are never touched.
func closeConnections(prefix, reason string) (int, error) {
	out, err := rabbitmqctl("list_connections", "-q", "--no-table-headers", "pid", "client_properties")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, line := range strings.Split(out, "\n") {
		pid, props, ok := strings.Cut(strings.TrimSpace(line), "\t")
		m := connectionName.FindStringSubmatch(props)
		if !ok || m == nil || !strings.HasPrefix(m[1], prefix) || !strings.HasPrefix(pid, "<") {
			continue
		}
		if _, err := rabbitmqctl("close_connection", pid, reason); err != nil {
			continue // it may have closed by itself meanwhile
		}
		n++
	}
	return n, nil
}

// brokerEnv reads a rabbit application variable: its Erlang term, such as
// "{ok,1800000}" or "undefined".
func brokerEnv(key string) (string, error) {
	out, err := rabbitmqctl("eval", fmt.Sprintf("application:get_env(rabbit, %s).", key))
	return strings.TrimSpace(out), err
}

// restoreBrokerEnv is the Erlang expression (without the final period)
// that puts key back to what brokerEnv read.
func restoreBrokerEnv(key, was string) string {
	if v, ok := strings.CutPrefix(was, "{ok,"); ok {
		return fmt.Sprintf("application:set_env(rabbit, %s, %s)", key, strings.TrimSuffix(v, "}"))
	}
	return fmt.Sprintf("application:unset_env(rabbit, %s)", key)
}

// deadLetter is one message taken from a dead-letter target.
type deadLetter struct {
	Op string
	D  amqp.Delivery
}

// takeAll takes every message of queue q (acking them), waiting up to wait
// for the first one, and returns them with their operation id: the
// dead-letter key header, else the "x-case" header.
func (e *env) takeAll(q string, wait time.Duration) []deadLetter {
	e.t.Helper()
	conn, err := amqp.Dial(e.amqp)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	var out []deadLetter
	deadline := time.Now().Add(wait)
	for {
		d, ok, err := ch.Get(q, true)
		if err != nil {
			if ae, isAMQP := err.(*amqp.Error); isAMQP && ae.Code == amqp.NotFound {
				return out
			}
			e.t.Fatalf("get %s: %v", q, err)
		}
		if !ok {
			if len(out) > 0 || time.Now().After(deadline) {
				return out
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		op := ""
		if k, ok := d.Headers[amqpidem.HeaderKey].(string); ok && k != "" {
			op = ledger.OpID(k)
		} else if c, ok := d.Headers["x-case"].(string); ok {
			op = c
		}
		out = append(out, deadLetter{Op: op, D: d})
	}
}

// countByOp counts dead letters per operation.
func countByOp(dls []deadLetter) map[string]int {
	m := map[string]int{}
	for _, d := range dls {
		m[d.Op]++
	}
	return m
}
