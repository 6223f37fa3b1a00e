package browser_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
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
// row, an operator follows the overview's count of failed records to
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
	const endpoint = "payments"
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
	take("pay-3001", time.Minute)
	take("pay-3002", 10*time.Millisecond) // stalled: its consumer died
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

	base := startConsole(t, "--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema, "--amqp", testenv.AMQPURL(t), "--queue", endpoint)
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

	do(chromedp.Navigate(base), chromedp.WaitVisible(`table.counts`))
	mustShow("overview", "Records by state", "Relay: outbox "+cfg.Schema+".amqpidem_outbox")
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

	do(chromedp.Navigate(base+"records?endpoint="+endpoint+"&state=stalled"), chromedp.WaitVisible(`table.records`))
	mustShow("stalled", "pay-3002", "(lease expired)")
	if strings.Contains(text(), "pay-3001") {
		t.Fatal("a live lease among the stalled")
	}

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
