package amqpidem

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// The blocked notifications of a connection are logged: blocked at warn
// level with the broker's reason, unblocked at info level. (Driven by a
// fake notification channel: a real one needs a broker alarm, see
// TestConsumerLogsBrokerAlarm.)
func TestLogBlocked(t *testing.T) {
	var out testenv.SyncBuffer
	log := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))
	blocked := make(chan amqp.Blocking, 2)
	blocked <- amqp.Blocking{Active: true, Reason: "low on memory"}
	blocked <- amqp.Blocking{Active: false}
	close(blocked)
	done := make(chan struct{})
	go func() {
		logBlocked(log, "orders", "publish", blocked)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("logBlocked did not return when its channel closed")
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("log lines: %q, want 2", lines)
	}
	for _, want := range []string{"level=WARN", "connection.blocked", "queue=orders", "connection=publish", `reason="low on memory"`} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("blocked line %q lacks %q", lines[0], want)
		}
	}
	for _, want := range []string{"level=INFO", "connection unblocked", "connection=publish", "blocked_for="} {
		if !strings.Contains(lines[1], want) {
			t.Errorf("unblocked line %q lacks %q", lines[1], want)
		}
	}
}

// Which broker errors end Run and which are retried.
func TestConsumerErrorClassification(t *testing.T) {
	c := &Consumer{cfg: ConsumerConfig{Config: Config{Queue: "orders"}}}
	own := &Consumer{cfg: ConsumerConfig{Config: Config{Queue: "orders"}}, ownDeclare: true}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	forced := &amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - broker forced connection closure", Server: true}
	for _, tc := range []struct {
		name      string
		err       error
		permanent bool
		ambiguous bool
		says      string
	}{
		{"dial credentials (socket closed)", dialError(amqp.ErrCredentials), true, true, "credentials"},
		{"dial access refused (broker's close)", dialError(&amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED - Login was refused", Server: true}), true, false, "credentials"},
		{"dial SASL", dialError(amqp.ErrSASL), true, false, "SASL"},
		{"dial vhost (socket closed)", dialError(amqp.ErrVhost), true, true, "vhost"},
		{"dial vhost not found", dialError(&amqp.Error{Code: amqp.NotAllowed, Reason: "NOT_ALLOWED - vhost nope not found", Server: true}), true, false, "vhost"},
		{"dial connection limit", dialError(&amqp.Error{Code: amqp.NotAllowed, Reason: "NOT_ALLOWED - connection limit (2) is reached", Server: true}), false, false, ""},
		{"dial refused", dialError(refused), false, false, ""},
		{"dial forced", dialError(forced), false, false, ""},
		{"declare precondition", c.setupError(stepDeclare, &amqp.Error{Code: amqp.PreconditionFailed, Server: true,
			Reason: "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'orders'"}), true, false, `"orders"`},
		{"own declare precondition", own.setupError(stepDeclare, &amqp.Error{Code: amqp.PreconditionFailed, Server: true,
			Reason: "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x'"}), true, false, "make Declare match"},
		{"own declare queue not found", own.setupError(stepDeclare, &amqp.Error{Code: amqp.NotFound, Server: true,
			Reason: "NOT_FOUND - no queue 'orders' in vhost '/'"}), true, false, "does not exist"},
		{"own declare exchange not found", own.setupError(stepDeclare, &amqp.Error{Code: amqp.NotFound, Server: true,
			Reason: "NOT_FOUND - no exchange 'x' in vhost '/'"}), false, false, ""},
		{"consume not found", c.setupError(stepConsume, &amqp.Error{Code: amqp.NotFound, Server: true,
			Reason: "NOT_FOUND - no queue 'orders' in vhost '/'"}), true, false, "does not exist"},
		{"consume access refused", c.setupError(stepConsume, &amqp.Error{Code: amqp.AccessRefused, Server: true,
			Reason: "ACCESS_REFUSED - queue 'orders' in vhost '/' in exclusive use"}), true, false, "permissions"},
		{"channel forced", c.setupError(stepChannel, forced), false, false, ""},
		{"qos closed", c.setupError(stepQos, amqp.ErrClosed), false, false, ""},
	} {
		var perm *permanentError
		isPerm := errors.As(tc.err, &perm)
		if isPerm != tc.permanent {
			t.Errorf("%s: permanent %v, want %v: %v", tc.name, isPerm, tc.permanent, tc.err)
			continue
		}
		if !isPerm {
			continue
		}
		var ae *amqp.Error
		if perm.ambiguous != tc.ambiguous || !errors.As(perm.err, &ae) || !strings.Contains(perm.err.Error(), tc.says) {
			t.Errorf("%s: %v (ambiguous %v); want one wrapping the *amqp.Error, saying %q, ambiguous %v",
				tc.name, perm.err, perm.ambiguous, tc.says, tc.ambiguous)
		}
	}
	if err := fmt.Sprint(dialError(refused)); !strings.Contains(err, "connection refused") {
		t.Errorf("transient dial error: %s", err)
	}
}
