package browser_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// images is where the tests write the screenshots docs/console.md shows,
// when SCREENSHOTS=1 (make screenshots).
const images = "../../../docs/images"

// shoot takes a screenshot of the page in ctx, and writes it to
// docs/images/name when SCREENSHOTS=1 (make screenshots), else into a
// temporary directory: every run takes them, so that a page that cannot
// be photographed fails the test, but only asked-for runs change the
// repository's images (each run's differ in their timestamps).
func shoot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	if len(png) == 0 {
		t.Fatalf("screenshot %s: empty", name)
	}
	dir := images
	if os.Getenv("SCREENSHOTS") != "1" {
		dir = t.TempDir()
	}
	if err := os.WriteFile(filepath.Join(dir, name), png, 0o644); err != nil {
		t.Fatal(err)
	}
}

// browse starts Chromium for t, its window 1200 px wide.
func browse(t *testing.T) context.Context {
	t.Helper()
	exe := chromium(t)
	alloc, cancel := chromedp.NewExecAllocator(context.Background(), append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1200, 800))...)
	t.Cleanup(cancel)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(cancel)
	ctx, cancel = context.WithTimeout(ctx, 90*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestBrowserRecordsAndRelay: in Chromium, against "amqpidem console
// --postgres" on a pgstore of seeded records and an outbox with a dead
// row, and --metrics-url on the /metrics of a real consumer of the
// endpoint's queue (promamqpidem) completing, deduplicating and
// dead-lettering messages, an operator sees the overview count the
// records exactly and chart the consumer's rates, finds a lease whose
// heartbeat stalled apart from an expired one, follows the overview's count of failed records to
// their list (a hostile key shown as text, no element made of it), opens
// a failed key's record, follows the dead-row count to the relay page,
// is refused a redrive posted by a page of another origin, redrives the
// dead row after its confirmation, and the row is pending again. Each page is photographed into docs/images for docs/console.md.
func TestBrowserRecordsAndRelay(t *testing.T) {
	ctx := browse(t)
	pool := pgenv.Pool(t, 4)
	bg := context.Background()
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1}
	if err := pgstore.Migrate(bg, pool, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	store, err := pgstore.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	// The endpoint is the queue of the consumer below: unique, as the
	// broker is shared.
	name := testenv.Name(t)
	endpoint := "payments-" + name[strings.LastIndexByte(name, '-')+1:]
	take := func(key string, ttl time.Duration) lock.Lease {
		res, err := store.Acquire(bg, lock.Request{Key: amqpidem.StoreKey(endpoint, key), TTL: ttl})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire(%q): %v %v", key, res.Status, err)
		}
		return res.Lease
	}
	for i := range 40 {
		if err := store.Complete(bg, take(fmt.Sprintf("pay-%04d", 1000+i), time.Minute), []byte("receipt")); err != nil {
			t.Fatal(err)
		}
	}
	for i, k := range []string{"pay-2001", hostileKey, "pay-2003"} {
		reason := "card declined"
		if i == 2 {
			reason = "insufficient funds"
		}
		if err := store.Fail(bg, take(k, time.Minute), reason); err != nil {
			t.Fatal(err)
		}
	}
	// Under the console's --lease-ttl 3m: pay-3001 was renewed just now;
	// pay-3003 has 50 s left, as a lease last renewed 2m10s ago (more
	// than two heartbeat intervals of 1m) has: its heartbeat stalled;
	// pay-3002 expired (its consumer died).
	take("pay-3001", 3*time.Minute)
	take("pay-3003", 50*time.Second)
	take("pay-3002", 10*time.Millisecond)
	ob, err := pgstore.NewOutbox(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	for _, rk := range []string{"invoice.created", "invoice.paid"} {
		if _, err := ob.Write(bg, tx, pgstore.Message{Exchange: "billing", RoutingKey: rk, Publishing: amqp.Publishing{Body: []byte(rk)}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(bg); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, "amqpidem_outbox"}.Sanitize()
	var deadID int64
	if err := pool.QueryRow(bg, "UPDATE "+table+` SET state = 'd', attempts = 10, last_error = 'NOT_FOUND - no exchange ''billing'' in vhost ''/''' WHERE id = (SELECT min(id) FROM `+table+") RETURNING id").Scan(&deadID); err != nil {
		t.Fatal(err)
	}

	metricsURL := runConsumer(t, store, endpoint)
	base := startConsole(t, "--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema, "--amqp", testenv.AMQPURL(t), "--queue", endpoint,
		"--lease-ttl", "3m", "--metrics-url", metricsURL, "--metrics-interval", "500ms")
	do := func(steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(ctx, steps...); err != nil {
			t.Fatal(err)
		}
	}
	text := func() string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Text(`main`))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	mustShow := func(what string, wants ...string) {
		t.Helper()
		page := text()
		for _, w := range wants {
			if !strings.Contains(page, w) {
				t.Fatalf("%s: no %q in:\n%s", what, w, page)
			}
		}
	}

	// The rates need two reads of the consumer's metrics, and the
	// consumer's deliveries between them: reload until the completed
	// rate is above 0 and the charts hold 8 rates (4 s).
	deadline := time.Now().Add(60 * time.Second)
	for {
		do(chromedp.Navigate(base), chromedp.WaitVisible(`table.counts`))
		rate, err := chromedp.Run(ctx, chromedp.Evaluate[string](`(document.querySelector('span.rate[data-kind="completed"]') || {}).textContent || ""`))
		if err != nil {
			t.Fatal(err)
		}
		points, err := chromedp.Run(ctx, chromedp.Evaluate[int](`(document.querySelector("svg.spark polyline") || {points: {numberOfItems: 0}}).points.numberOfItems`))
		if err != nil {
			t.Fatal(err)
		}
		if rate != "" && rate != "0/s" && points >= 8 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no completed rate on the overview in 60 s:\n%s", text())
		}
		time.Sleep(300 * time.Millisecond)
	}
	mustShow("overview", "Records by state", "Relay: outbox "+cfg.Schema+".amqpidem_outbox", "Rates from http://127.0.0.1:",
		"exact: ", "processed", "duplicates", "dead-lettered")
	// The charts are drawn: a polyline with points for each rate.
	lines, err := chromedp.Run(ctx, chromedp.Evaluate[int](`[...document.querySelectorAll("svg.spark polyline")].filter(p => p.points.numberOfItems > 0).length`))
	if err != nil || lines != 5 {
		t.Fatalf("%d charts drawn (%v), want 5", lines, err)
	}
	// One stalled heartbeat, one expired lease, counted exactly.
	for sel, want := range map[string]string{`a.count.stalled`: "1", `a.count.expired`: "1"} {
		got, err := chromedp.Run(ctx, chromedp.Text(sel))
		if err != nil || got != want {
			t.Fatalf("%s: %q (%v), want %q", sel, got, err, want)
		}
	}
	if strings.Contains(text(), pgenv.DSN(t)) {
		t.Fatal("the DSN on the overview")
	}
	shoot(t, ctx, "console-overview.png")

	do(chromedp.Click(`a.count.failed`), chromedp.WaitVisible(`table.records`))
	mustShow("failed records", "pay-2001", `<img src=x onerror="document.title='pwned'">\x1b[2J`, "insufficient funds", "End of the listing.")
	n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll("main img").length`))
	if err != nil || n != 0 {
		t.Fatalf("the hostile key made %d img elements (%v)", n, err)
	}
	if strings.Contains(text(), "pay-1001") {
		t.Fatal("a completed record among the failed")
	}
	shoot(t, ctx, "console-records.png")

	do(chromedp.Navigate(base+"records?endpoint="+endpoint+"&state=expired"), chromedp.WaitVisible(`table.records`))
	mustShow("expired", "pay-3002", "(lease expired)")
	if page := text(); strings.Contains(page, "pay-3001") || strings.Contains(page, "pay-3003") {
		t.Fatal("a live lease among the expired")
	}
	do(chromedp.Navigate(base), chromedp.WaitVisible(`a.count.stalled`), chromedp.Click(`a.count.stalled`), chromedp.WaitVisible(`table.records`))
	mustShow("stalled", "pay-3003", "(heartbeat stalled)", "heartbeat stalled: renewed 2m")
	if page := text(); strings.Contains(page, "pay-3001") || strings.Contains(page, "pay-3002") {
		t.Fatal("a healthy or expired lease among the stalled")
	}
	shoot(t, ctx, "console-stalled.png")

	do(chromedp.Navigate(base+"records?endpoint="+endpoint+"&state=failed"), chromedp.WaitVisible(`table.records`),
		chromedp.Click(`a[href*="key=pay-2003"]`), chromedp.WaitVisible(`table.record`))
	mustShow("key page", "pay-2003", "failed", "insufficient funds")
	shoot(t, ctx, "console-key.png")

	// A page of another origin posting a redrive without the token (a
	// forged request riding the operator's browser) is refused, and the
	// row stays dead.
	forged := `data:text/html,<form method="post" action="` + base + `redrive"><input name="id" value="` +
		fmt.Sprint(deadID) + `"></form><script>document.forms[0].submit()</script>`
	do(chromedp.Navigate(forged), chromedp.WaitVisible(`main.problem`))
	mustShow("forged redrive", "Not confirmed here", "nothing was changed")
	var before string
	if err := pool.QueryRow(bg, "SELECT state FROM "+table+" WHERE id = $1", deadID).Scan(&before); err != nil || before != "d" {
		t.Fatalf("the row after a forged redrive: state %q (%v), want still dead", before, err)
	}

	do(chromedp.Navigate(base), chromedp.WaitVisible(`a.count.dead`), chromedp.Click(`a.count.dead`), chromedp.WaitVisible(`table.rows`))
	mustShow("relay", "NOT_FOUND - no exchange 'billing'", "invoice.created")
	shoot(t, ctx, "console-relay.png")
	do(chromedp.Click(`a.action[href^="redrive?id="]`), chromedp.WaitVisible(`button.confirm`))
	mustShow("redrive confirmation", "would be pending again", "--dry-run: nothing changed")
	shoot(t, ctx, "console-redrive.png")
	do(chromedp.Click(`button.confirm`), chromedp.WaitVisible(`pre.result`))
	mustShow("redrive result", "1 dead row pending again", ": done")
	var state string
	if err := pool.QueryRow(bg, "SELECT state FROM "+table+" WHERE id = $1", deadID).Scan(&state); err != nil || state != "p" {
		t.Fatalf("the redriven row: state %q (%v), want pending", state, err)
	}
}

// runConsumer runs a consumer of queue on store, observed by a
// promamqpidem.Metrics served on a /metrics of its own, and publishes to
// it until the test ends: new keys (completed), each fourth one again
// (a duplicate), each tenth a key its handler refuses (dead-lettered). It
// returns the /metrics URL.
func runConsumer(t *testing.T, store lock.Store, queue string) string {
	t.Helper()
	url := testenv.AMQPURL(t)
	testenv.DeleteQueues(t, url, queue, queue+".dlq")
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	m := promamqpidem.New(promamqpidem.Options{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	// Its leases last 3m, the --lease-ttl the console is told: with the
	// default 30 s, the console would take them for leases renewed 2.5
	// minutes ago, stalled.
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{URL: url, Config: amqpidem.Config{Queue: queue,
		Logger: slog.New(slog.DiscardHandler), SigningKey: []byte(signingKey), Observer: m, LeaseTTL: 3 * time.Minute}},
		amqpidem.HandlerFunc(func(_ context.Context, d *amqp.Delivery) ([]byte, error) {
			if strings.HasPrefix(d.MessageId, "bad-") {
				return nil, amqpidem.Permanent(errors.New("card declined"))
			}
			return []byte("ok"), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	pub := amqpidem.NewPublisher(conn)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		// Bounded: 90 s at 20 a second, and the test's end.
		for i := 0; i < 1800; i++ {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			id := fmt.Sprintf("live-%05d", i)
			if i%10 == 9 {
				id = fmt.Sprintf("bad-%05d", i)
			}
			if i%4 == 3 {
				id = fmt.Sprintf("live-%05d", i-1) // the one before, again: a duplicate
			}
			if err := pub.Publish(ctx, "", queue, amqp.Publishing{MessageId: id, Body: []byte("pay")}); err != nil && ctx.Err() == nil {
				t.Errorf("publish: %v", err)
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		pub.Close()
	})
	return srv.URL + "/metrics"
}
