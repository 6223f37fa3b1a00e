package testenv_test

import (
	"context"
	"errors"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// failoverTimeout bounds publishing and consuming while a quorum queue
// elects a new leader.
const failoverTimeout = 30 * time.Second

func TestRabbitCluster(t *testing.T) {
	t.Parallel()
	var pids []int
	t.Run("failover", func(t *testing.T) {
		start := time.Now()
		r := testenv.RabbitCluster(t)
		t.Logf("cluster up after %v", time.Since(start).Round(time.Millisecond))
		if got, want := len(r.Nodes), 3; got != want {
			t.Fatalf("len(Nodes): got %d, want %d", got, want)
		}
		names := make([]string, len(r.Nodes))
		for i, n := range r.Nodes {
			names[i] = n.Name
			if n.Pid() == 0 {
				t.Fatalf("node %s: Pid() is 0 after start", n.Name)
			}
		}
		slices.Sort(names)
		if got := r.RunningNodes(); !slices.Equal(got, names) {
			t.Fatalf("running nodes: got %v, want %v", got, names)
		}
		a, b, c := r.Nodes[0], r.Nodes[1], r.Nodes[2]
		q := testenv.Name(t)

		ch := channel(t, a.AMQPURL)
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			t.Fatalf("declaring quorum queue %s through %s: %v", q, a.Name, err)
		}
		if err := publishConfirmed(b.AMQPURL, q, "one", 10*time.Second); err != nil {
			t.Fatalf("publishing through %s: %v", b.Name, err)
		}
		if err := consume(c.AMQPURL, q, "one", 10*time.Second); err != nil {
			t.Fatalf("consuming through %s: %v", c.Name, err)
		}

		leader := r.QueueLeader(q)
		t.Logf("leader of %s: %s; killing it", q, leader.Name)
		killed := time.Now()
		leader.Kill()
		if got := leader.Pid(); got != 0 {
			t.Fatalf("node %s: Pid() after Kill: got %d, want 0", leader.Name, got)
		}
		var live []*testenv.RabbitNode
		for _, n := range r.Nodes {
			if n != leader {
				live = append(live, n)
			}
		}
		if err := publishConfirmed(live[0].AMQPURL, q, "two", failoverTimeout); err != nil {
			t.Fatalf("publishing through %s after killing %s: %v", live[0].Name, leader.Name, err)
		}
		if err := consume(live[1].AMQPURL, q, "two", failoverTimeout); err != nil {
			t.Fatalf("consuming through %s after killing %s: %v", live[1].Name, leader.Name, err)
		}
		t.Logf("queue available through the live nodes %v after the kill", time.Since(killed).Round(time.Millisecond))
		if nl := r.QueueLeader(q); nl == leader {
			t.Fatalf("leader of %s after killing %s: still %s", q, leader.Name, nl.Name)
		}
		if got, want := r.RunningNodes(), []string{live[0].Name, live[1].Name}; !slices.Equal(got, sorted(want)) {
			t.Fatalf("running nodes after killing %s: got %v, want %v", leader.Name, got, sorted(want))
		}

		leader.Start()
		if got := r.RunningNodes(); !slices.Equal(got, names) {
			t.Fatalf("running nodes after restarting %s: got %v, want %v", leader.Name, got, names)
		}
		if err := publishConfirmed(leader.AMQPURL, q, "three", failoverTimeout); err != nil {
			t.Fatalf("publishing through restarted %s: %v", leader.Name, err)
		}
		if err := consume(leader.AMQPURL, q, "three", failoverTimeout); err != nil {
			t.Fatalf("consuming through restarted %s: %v", leader.Name, err)
		}
		for _, n := range r.Nodes {
			pids = append(pids, n.Pid())
		}
	})
	// The subtest's t.Cleanup has run: every node must be gone.
	for _, pid := range pids {
		if p, err := os.FindProcess(pid); err == nil {
			if err := p.Signal(syscall.Signal(0)); err == nil {
				t.Errorf("process %d of a node still runs after t.Cleanup", pid)
			}
		}
	}
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// channel returns a channel on a new connection to url, closed in t.Cleanup.
func channel(t *testing.T, url string) *amqp.Channel {
	t.Helper()
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatalf("dialing %s: %v", url, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("opening a channel on %s: %v", url, err)
	}
	return ch
}

// publishConfirmed publishes body to queue through url with publisher
// confirms, on a new connection per attempt, until one is confirmed or
// timeout passes. A retry after a lost confirm may publish body twice.
func publishConfirmed(url, queue, body string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var lastErr error
	for ctx.Err() == nil {
		lastErr = publishOnce(ctx, url, queue, body)
		if lastErr == nil {
			return nil
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	return errors.Join(ctx.Err(), lastErr)
}

func publishOnce(ctx context.Context, url, queue, body string) error {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(actx, "", queue, true, false,
		amqp.Publishing{DeliveryMode: amqp.Persistent, Body: []byte(body)})
	if err != nil {
		return err
	}
	ok, err := dc.WaitContext(actx)
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("nacked")
	}
	return nil
}

// consume consumes from queue through url, acknowledging what it gets,
// until it gets body or timeout passes. Other bodies (duplicates of earlier
// publishes) are acknowledged and skipped.
func consume(url, queue, body string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var lastErr error
	for ctx.Err() == nil {
		var found bool
		found, lastErr = consumeOnce(ctx, url, queue, body)
		if found {
			return nil
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	return errors.Join(ctx.Err(), lastErr)
}

func consumeOnce(ctx context.Context, url, queue, body string) (bool, error) {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		return false, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return false, err
	}
	if err := ch.Qos(1, 0, false); err != nil {
		return false, err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return false, err
	}
	for {
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case d, ok := <-deliveries:
			if !ok {
				return false, errors.New("delivery channel closed")
			}
			if err := d.Ack(false); err != nil {
				return false, err
			}
			if string(d.Body) == body {
				return true, nil
			}
		}
	}
}
