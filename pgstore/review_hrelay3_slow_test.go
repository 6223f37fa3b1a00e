package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3PublishOutlastsTimeout: a row whose publish outlasts
// PublishTimeout (here an 8 MiB body through a link of 8 MiB/s, a proxy
// that throttles what the relay sends, against 100 ms; in production a
// large body on a slow link) is not a refusal: the confirm not awaited to
// the end says nothing about the message, and the same error comes from a
// broker that is slow or blocked (a memory alarm), when counting it would
// turn healthy rows dead. So its row stays pending with no attempts, never
// dead, published again after each backoff (copies reach the queue: the
// broker took it after the relay gave up), and, Ordered, its key's next
// row waits behind it. This documents the behaviour (docs/relay.md), and
// checks that the relay's warning names the row's id, so that an operator
// can find it.
func TestHrelay3PublishOutlastsTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("8 s of 8 MiB publishes")
	}
	r := newOutboxRig(t)
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	slow := r.msg("")
	slow.OrderKey = "k"
	slow.Publishing.MessageId = "slow"
	slow.Publishing.Body = bytes.Repeat([]byte{'s'}, 8<<20)
	next := r.msg("next")
	next.OrderKey = "k"
	next.Publishing.MessageId = "next"
	other := r.msg("other")
	other.Publishing.MessageId = "other"
	r.write(true, slow, next, other)
	var slowID int64
	if err := r.pool.QueryRow(ctx, "SELECT id FROM "+table+" WHERE message_id = 'slow'").Scan(&slowID); err != nil {
		t.Fatal(err)
	}
	var log testenv.SyncBuffer
	t.Cleanup(func() {
		s := log.String()
		if len(s) > 3000 {
			s = s[:3000]
		}
		t.Logf("relay log:\n%s", s)
	})
	rl, stop := startRelay(t, r.ob, pgstore.RelayConfig{Dial: hrelay3SlowLink(t, 8<<20),
		Ordered: true, PublishTimeout: 100 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: 100 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, PollInterval: 50 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	const watch = 8 * time.Second
	time.Sleep(watch)
	stopping := time.Now()
	stop()
	t.Logf("Shutdown took %v", time.Since(stopping))
	var state string
	var attempts int
	if err := r.pool.QueryRow(ctx, "SELECT state, attempts FROM "+table+" WHERE message_id = 'slow'").Scan(&state, &attempts); err != nil {
		t.Fatal(err)
	}
	tries := strings.Count(log.String(), "level=WARN msg=\"pgstore: relay: publish ")
	deliveries := r.drain()
	pub, refusedN, dead := rl.Counts()
	t.Logf("after %v: slow row %s with %d attempts; %d failed rounds logged; deliveries %v; counts published %d refused %d dead %d",
		watch, state, attempts, tries, deliveries, pub, refusedN, dead)
	if tries < 3 {
		t.Fatalf("%d publishes of the slow row timed out in %v: the reproduction did not reproduce", tries, watch)
	}
	if state != "p" || attempts != 0 || refusedN != 0 {
		t.Errorf("slow row %s with %d attempts (%d refusals): a publish that outlasts PublishTimeout is not a refusal", state, attempts, refusedN)
	}
	// other may be published twice: sent after the slow body on the one
	// connection, its confirm can be late too.
	if deliveries["other"] == 0 || deliveries["next"] != 0 {
		t.Errorf("deliveries %v: want other, and next held back behind its key's slow head", deliveries)
	}
	if !regexp.MustCompile(fmt.Sprintf(`\(row ids ([0-9]+ )*%d[ )]`, slowID)).MatchString(log.String()) {
		t.Errorf("no warning names the slow row's id %d: the operator cannot tell which row holds its key back", slowID)
	}
}

// hrelay3Host returns the host:port of an AMQP URL.
func hrelay3Host(t *testing.T, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

// hrelay3SlowLink returns a Dial for RabbitMQ through a proxy that passes
// what the relay sends at rate bytes per second (what the broker sends
// back unthrottled): a slow link.
func hrelay3SlowLink(t *testing.T, rate int) func() (*amqp.Connection, error) {
	t.Helper()
	px := testenv.StartProxy(t, hrelay3Host(t, testenv.AMQPURL(t)), func(from, to net.Conn) {
		buf := make([]byte, 64<<10)
		for {
			n, err := from.Read(buf)
			if n > 0 {
				time.Sleep(time.Duration(n) * time.Second / time.Duration(rate))
				if _, werr := to.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}, nil)
	u := px.URL(t, testenv.AMQPURL(t))
	return func() (*amqp.Connection, error) { return amqp.Dial(u) }
}
