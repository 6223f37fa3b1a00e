//go:build linux

package chaos_test

import (
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 6, the broker's consumer timeout: consumer_timeout lowered to
// 10 s (and the channel tick that checks it to 1 s, so that it is checked
// in time) while a handler runs 20 s. The broker closes the handler's
// channel and redelivers the message; the other consumer finds the lease
// held (busy) until the first handler completes; then the message is a
// duplicate. Exactly one execution, one effect.
//
// It changes a broker-wide setting, so it runs only in full mode (make
// chaos), never beside other packages' tests. The previous values are
// restored in t.Cleanup, and by a watchdog process if the test binary dies
// first.
func TestChaos06ConsumerTimeout(t *testing.T) {
	if !full {
		t.Skip("changes the broker-wide consumer_timeout: runs only with CHAOS_FULL=1 (make chaos)")
	}
	e := newEnv(t, envOptions{})
	setBroker(t, map[string]string{"consumer_timeout": "10000", "channel_tick_interval": "1000"})

	long := workload.Op{ID: e.name + "-long", Plan: workload.Plan{WorkMS: 20_000}}
	short := workload.Storm(e.name+"-op", 50, 2, 20, e.rng)
	flags := []string{"-lease", "5s", "-in-progress-delay", "1s", "-log-level", "INFO"}
	a := e.consumer(e.name+"-a", append(flags, "-prefetch", "1")...)
	e.publish([]workload.Op{long})
	e.waitFor("A to start the long handler", time.Minute, func() bool {
		return e.count(`SELECT count(*) FROM executions WHERE op_id = $1`, long.ID) == 1
	}, nil)
	e.consumer(e.name+"-b", flags...)
	e.publish(short)
	e.settle(1+len(short), 3*time.Minute, 3*time.Second)
	e.terminateAll()
	e.report("consumer-timeout", nil, false)

	if n := e.count(`SELECT count(*) FROM executions WHERE op_id = $1`, long.ID); n != 1 {
		t.Errorf("the long operation ran %d times, want once", n)
	}
	timedOut := strings.Contains(a.output(), "timed out") || e.grepAll("delivery acknowledgement") > 0
	busy, dup, completed := 0, 0, 0
	for _, ev := range e.events() {
		if ev.Op != long.ID {
			continue
		}
		switch ev.Outcome {
		case "busy":
			busy++
		case "duplicate":
			dup++
		case "completed":
			completed++
			t.Logf("consumer-timeout: long operation completed by %s after %d ms: err %q", ev.Consumer, ev.HandlerMS, ev.Err)
		}
	}
	t.Logf("consumer-timeout: channel closed by the broker's timeout: %v; the redelivery was busy %d times, then a duplicate %d times",
		timedOut, busy, dup)
	if !timedOut {
		t.Errorf("the broker never closed the long handler's channel for its consumer timeout")
	}
	if completed != 1 || busy == 0 {
		t.Errorf("long operation: %d completed and %d busy events; want 1 and at least 1", completed, busy)
	}
}

// setBroker sets rabbit application variables for the test and puts the
// previous values back in t.Cleanup. A watchdog process restores them after
// five minutes if the test binary is killed before its cleanup runs.
func setBroker(t *testing.T, vars map[string]string) {
	t.Helper()
	var restore []string
	for k := range vars {
		was, err := brokerEnv(k)
		if err != nil {
			t.Fatal(err)
		}
		restore = append(restore, restoreBrokerEnv(k, was))
	}
	expr := strings.Join(restore, ", ") + "."
	watchdog := exec.Command("sh", "-c", `sleep 300; exec rabbitmqctl eval "$1"`, "watchdog", expr)
	// Its own session: it outlives the test binary, and its process group
	// (sh and its sleep) is killed as one.
	watchdog.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := watchdog.Start(); err != nil {
		t.Fatalf("starting the watchdog: %v", err)
	}
	t.Cleanup(func() {
		if _, err := rabbitmqctl("eval", expr); err != nil {
			t.Errorf("restoring the broker's settings (%s): %v", expr, err)
		}
		_ = syscall.Kill(-watchdog.Process.Pid, syscall.SIGKILL)
		_ = watchdog.Wait()
		t.Logf("broker settings restored: %s", expr)
	})
	for k, v := range vars {
		if _, err := rabbitmqctl("eval", fmt.Sprintf("application:set_env(rabbit, %s, %s).", k, v)); err != nil {
			t.Fatal(err)
		}
	}
}
