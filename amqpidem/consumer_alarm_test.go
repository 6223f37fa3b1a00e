package amqpidem_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// alarmEnv names the environment variable that enables
// TestConsumerLogsBrokerAlarm: it sets off a memory alarm on the local
// broker, which blocks every publishing connection of the broker for a
// second or two, other tests' too.
const alarmEnv = "AMQPIDEM_TEST_BROKER_ALARM"

// rabbitmqctl runs rabbitmqctl with args, for at most 30 s.
func rabbitmqctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// A broker alarm blocks the publishing connection: connection.blocked is
// logged at warn level, its end at info level, and the copy goes through
// once the alarm is over. Only with AMQPIDEM_TEST_BROKER_ALARM=1 (see
// alarmEnv); TestLogBlocked covers the logging without a broker.
func TestConsumerLogsBrokerAlarm(t *testing.T) {
	if os.Getenv(alarmEnv) != "1" {
		t.Skipf("sets off a broker memory alarm; set %s=1 to run it", alarmEnv)
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Skip("no rabbitmqctl")
	}
	e := newEnv(t, nil)
	prev, err := rabbitmqctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().")
	if err != nil {
		t.Skipf("cannot read the memory watermark: %v: %s", err, prev)
	}
	restoreArgs := []string{"set_vm_memory_high_watermark", prev}
	if rest, ok := strings.CutPrefix(prev, "{absolute,"); ok { // {absolute,1073741824}
		restoreArgs = []string{"set_vm_memory_high_watermark", "absolute", strings.TrimSuffix(rest, "}")}
	}
	restored := false
	restore := func() {
		if restored {
			return
		}
		if out, err := rabbitmqctl(restoreArgs...); err != nil {
			t.Errorf("restoring the memory watermark (%v): %v: %s", restoreArgs, err, out)
			return
		}
		restored = true
	}

	logs, logger := newConnLogs()
	alarmOn := make(chan struct{})
	var ran runs
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{Config: amqpidem.Config{Logger: logger, Observer: rec,
		Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(100 * time.Millisecond) }}},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			if ran.add(d.MessageId) == 1 {
				select { // then fail: a delayed requeue, published during the alarm
				case <-alarmOn:
				case <-time.After(20 * time.Second):
				}
				return nil, errors.New("try again")
			}
			return nil, nil
		}))
	e.publish(amqp.Publishing{MessageId: "m", Body: []byte("x")})
	eventually(t, 10*time.Second, "the handler to start", func() bool { return ran.get("m") == 1 })

	t.Cleanup(restore) // before the consumer's Shutdown (cleanups run last first), which publishes
	if out, err := rabbitmqctl("set_vm_memory_high_watermark", "0.0000001"); err != nil {
		t.Fatalf("setting off the alarm: %v: %s", err, out)
	}
	close(alarmOn)
	deadline := time.Now().Add(15 * time.Second)
	for !logs.hasLine("level=WARN", "connection.blocked", "connection=publish") && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	restore()
	if !logs.hasLine("level=WARN", "connection.blocked", "connection=publish") {
		t.Fatalf("connection.blocked not logged:\n%s", logs)
	}
	rec.waitFor(t, 20*time.Second, "m completed after the alarm", func(evs []amqpidem.Event) bool {
		return count(evs, "m", amqpidem.Completed) == 1
	})
	if !logs.hasLine("level=INFO", "connection unblocked", "connection=publish") {
		t.Fatalf("connection.unblocked not logged:\n%s", logs)
	}
	if logs.hasLine("connection.blocked", "connection=consume") {
		t.Fatalf("the consuming connection, which publishes nothing, was blocked:\n%s", logs)
	}
}
