package browser_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

const signingKey = "browser-signing-key-0123456789"

// hostileKey makes an element, with a handler that would run a script,
// when put into a page raw.
const hostileKey = `<img src=x onerror="document.title='pwned'">` + "\x1b[2J"

// chromium is the browser's path; the test is skipped (failed under
// CI=true) without one.
func chromium(t *testing.T) string {
	for _, p := range []string{os.Getenv("CHROMIUM"), "/usr/bin/chromium", "/usr/bin/chromium-browser"} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("no Chromium (apt-get install chromium, or set CHROMIUM)")
	}
	t.Skip("no Chromium (apt-get install chromium, or set CHROMIUM)")
	return ""
}

// TestBrowserReplayWithForget: in Chromium, an operator finds a queue's
// dead letters from the overview's form, sees a hostile key shown as text
// (no element made of it, no script run), asks to replay a failed
// message's dead letter, is shown that a plain replay would leave it,
// follows "replay with forget", confirms, and the fixed handler runs
// exactly once. The dead letters page and the confirmation are
// photographed into docs/images for docs/console.md.
func TestBrowserReplayWithForget(t *testing.T) {
	exe := chromium(t)
	url := testenv.AMQPURL(t)
	queue := testenv.Name(t)
	prefix := "browser-" + queue
	store, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
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
	testenv.DeleteQueues(t, url, queue, queue+".dlq")
	var broken atomic.Bool
	broken.Store(true)
	var mu sync.Mutex
	runs := map[string]int{}
	events := make(chan amqpidem.Event, 100)
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{URL: url, Config: amqpidem.Config{Queue: queue,
		Logger: slog.New(slog.DiscardHandler), SigningKey: []byte(signingKey),
		Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { events <- e })}},
		amqpidem.HandlerFunc(func(_ context.Context, d *amqp.Delivery) ([]byte, error) {
			if broken.Load() {
				return nil, amqpidem.Permanent(errors.New("card declined"))
			}
			mu.Lock()
			runs[d.MessageId]++
			mu.Unlock()
			return []byte("ok"), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	pub := amqpidem.NewPublisher(conn)
	t.Cleanup(pub.Close)
	for _, k := range []string{hostileKey, "pay-1042"} {
		if err := pub.Publish(context.Background(), "", queue, amqp.Publishing{MessageId: k, Body: []byte("pay")}); err != nil {
			t.Fatal(err)
		}
	}
	wait := func(o amqpidem.Outcome, n int) {
		t.Helper()
		deadline := time.After(60 * time.Second)
		for seen := 0; seen < n; {
			select {
			case e := <-events:
				if e.Outcome == o {
					seen++
				}
			case <-deadline:
				t.Fatalf("%d of %d %v outcomes in 60 s", seen, n, o)
			}
		}
	}
	wait(amqpidem.DeadLettered, 2)

	base := startConsole(t, "--redis", "redis://"+testenv.RedisAddr(t)+"/0", "--amqp", url, "--prefix", prefix, "--queue", queue)

	alloc, cancel := chromedp.NewExecAllocator(context.Background(), append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1200, 800))...)
	t.Cleanup(cancel)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(cancel)
	ctx, cancel = context.WithTimeout(ctx, 90*time.Second)
	t.Cleanup(cancel)

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
	count := func(selector string) int {
		t.Helper()
		n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll("`+selector+`").length`))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}

	do(chromedp.Navigate(base),
		chromedp.SendKeys(`form[action="dlq"] input[name="queue"]`, queue),
		chromedp.Submit(`form[action="dlq"] input[name="queue"]`),
		chromedp.WaitVisible(`table.letters`))
	shoot(t, ctx, "console-dlq.png")
	page := text()
	title, err := chromedp.Run(ctx, chromedp.Title())
	if err != nil {
		t.Fatal(err)
	}
	if n := count("img"); n != 0 || strings.Contains(title, "pwned") {
		t.Fatalf("the hostile key made %d img elements, title %q", n, title)
	}
	for _, want := range []string{`<img src=x onerror="document.title='pwned'">\x1b[2J`, "pay-1042", "signed", "card declined"} {
		if !strings.Contains(page, want) {
			t.Fatalf("dead letters page: no %q in:\n%s", want, page)
		}
	}

	do(chromedp.Click(`a.action[href*="key=pay-1042"]`), chromedp.WaitVisible(`pre.report`))
	page = text()
	if !strings.Contains(page, "left") || !strings.Contains(page, "--forget") {
		t.Fatalf("a plain replay's confirmation: want it left, needing forget:\n%s", page)
	}
	if n := count("form[method=post]"); n != 0 {
		t.Fatalf("a plain replay that would do nothing is offered for confirmation:\n%s", page)
	}

	broken.Store(false) // the cause, fixed
	do(chromedp.Click(`a[href*="forget=1"]`), chromedp.WaitVisible(`button.confirm`))
	if page = text(); !strings.Contains(page, "would replay") {
		t.Fatalf("forget-and-replay confirmation:\n%s", page)
	}
	shoot(t, ctx, "console-replay-forget.png")
	do(chromedp.Click(`button.confirm`), chromedp.WaitVisible(`pre.result`))
	if page = text(); !strings.Contains(page, "replayed (forgot failed record)") || !strings.Contains(page, ": done") {
		t.Fatalf("the replay's result:\n%s", page)
	}
	wait(amqpidem.Completed, 1)
	time.Sleep(200 * time.Millisecond) // a second run, if any, would show by now
	mu.Lock()
	n := runs["pay-1042"]
	mu.Unlock()
	if n != 1 {
		t.Fatalf("the handler ran %d times for pay-1042, want 1", n)
	}
}

// startConsole builds "amqpidem console" from this checkout, runs it on
// 127.0.0.1 with args and returns the URL it serves; it is interrupted
// (by its process id) when the test ends.
func startConsole(t *testing.T, args ...string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "amqpidem")
	build := exec.Command("go", "build", "-o", bin, "./cmd/amqpidem")
	build.Dir = "../../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building amqpidem: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, append([]string{"console", "--listen", "127.0.0.1:0"}, args...)...)
	cmd.Env = append(os.Environ(), "AMQPIDEM_SIGNING_KEY="+signingKey)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		cmd.Wait()
	})
	served := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if _, rest, ok := strings.Cut(sc.Text(), "serving "); ok {
				served <- strings.Fields(rest)[0]
			}
		}
		io.Copy(io.Discard, stderr)
	}()
	select {
	case u := <-served:
		return u
	case <-time.After(60 * time.Second):
		t.Fatal("the console did not say where it serves within 60 s")
	}
	return ""
}
