package main_test

import (
	"context"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// browser is an HTTP client with cookies, as a browser is.
type browser struct {
	t    *testing.T
	c    *http.Client
	base string
}

func newBrowser(t *testing.T, base string) *browser {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &browser{t: t, c: &http.Client{Jar: jar}, base: base}
}

func (b *browser) do(method, path string, form url.Values, status int) string {
	b.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, b.base+path, body)
	if err != nil {
		b.t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	page, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		b.t.Fatalf("%s %s: %d, want %d:\n%s", method, path, resp.StatusCode, status, page)
	}
	return string(page)
}

var hiddenInput = regexp.MustCompile(`<input type="hidden" name="(\w+)" value="([0-9a-f]*)">`)

// confirmForm is the form of a confirmation page: its action and fields.
func confirmForm(t *testing.T, page string) (string, url.Values) {
	t.Helper()
	m := regexp.MustCompile(`<form method="post" action="(\w+)">`).FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no confirmation form on the page:\n%s", page)
	}
	form := url.Values{}
	for _, f := range hiddenInput.FindAllStringSubmatch(page, -1) {
		form.Set(f[1], f[2])
	}
	return m[1], form
}

// TestConsoleReplayAndForget drives the console of the binary as an
// operator would: the dead letter of a failed key is found on its queue's
// page; replaying it alone is shown to leave it (its record failed) and
// not offered; a POST without the page's CSRF token changes nothing;
// forget-and-replay, confirmed, runs the fixed handler exactly once; a
// failed record is forgotten after its confirmation, but not when its
// fence changed since it was shown; every action is logged.
func TestConsoleReplayAndForget(t *testing.T) {
	r := newRig(t, 1)
	r.publish("pay-1042", "pay-2")
	r.waitOutcomes(amqpidem.DeadLettered, 2)
	base, logged := r.startConsoleLog(nil, "--listen", "127.0.0.1:0", "--queue", r.queue)
	b := newBrowser(t, base)

	dlq := b.do("GET", "dlq?queue="+r.queue, nil, http.StatusOK)
	if !strings.Contains(dlq, `href="replay?queue=`+r.queue+`&amp;dlq=&amp;key=pay-1042">Replay…</a>`) {
		t.Fatalf("no Replay… link for pay-1042:\n%s", dlq)
	}
	plain := b.do("GET", "replay?queue="+r.queue+"&dlq=&key=pay-1042", nil, http.StatusOK)
	if !strings.Contains(plain, "left") || !strings.Contains(plain, "--forget") || strings.Contains(plain, `<form method="post"`) {
		t.Fatalf("replay without forget: want the dry run's left and no confirmation:\n%s", plain)
	}

	r.broken.Store(false) // the cause, fixed
	confirm := b.do("GET", "replay?queue="+r.queue+"&key=pay-1042&forget=1", nil, http.StatusOK)
	for _, want := range []string{"would replay", "deleted first", "Forget the failed record and replay"} {
		if !strings.Contains(confirm, want) {
			t.Fatalf("forget-and-replay confirmation: no %q:\n%s", want, confirm)
		}
	}
	action, form := confirmForm(t, confirm)
	noToken := url.Values{}
	for k, v := range form {
		if k != "csrf" {
			noToken[k] = v
		}
	}
	b.do("POST", action, noToken, http.StatusForbidden)
	wrong := url.Values{}
	for k, v := range form {
		wrong[k] = v
	}
	wrong.Set("csrf", strings.Repeat("0", 64))
	b.do("POST", action, wrong, http.StatusForbidden)
	if n := r.dlqLen(); n != 2 {
		t.Fatalf("after refused POSTs the dead-letter queue holds %d, want 2", n)
	}
	done := b.do("POST", action, form, http.StatusOK)
	if !strings.Contains(done, "replayed (forgot failed record)") {
		t.Fatalf("forget-and-replay: no replay in the report:\n%s", done)
	}
	r.waitOutcomes(amqpidem.Completed, 1)
	r.mu.Lock()
	runs := r.runs["pay-1042"]
	r.mu.Unlock()
	if runs != 1 {
		t.Fatalf("the handler ran %d times for pay-1042, want 1", runs)
	}
	if n := r.dlqLen(); n != 1 {
		t.Fatalf("the dead-letter queue holds %d after the replay, want 1 (pay-2's)", n)
	}

	// Forget pay-2's failed record; first with a fence changed since.
	confirm = b.do("GET", "forget?endpoint="+r.queue+"&key=pay-2", nil, http.StatusOK)
	if !strings.Contains(confirm, "would forget the failed record") {
		t.Fatalf("forget confirmation: no dry run:\n%s", confirm)
	}
	action, form = confirmForm(t, confirm)
	stale := url.Values{}
	for k, v := range form {
		stale[k] = v
	}
	stale.Set("fence", hex.EncodeToString([]byte("1")))
	if page := b.do("POST", action, stale, http.StatusConflict); !strings.Contains(page, "changed since it was shown") {
		t.Fatalf("a stale fence: %s", page)
	}
	skey := amqpidem.StoreKey(r.queue, "pay-2")
	if _, err := r.store.Inspect(context.Background(), skey); err != nil {
		t.Fatalf("the record after a refused forget: %v", err)
	}
	if page := b.do("POST", action, form, http.StatusOK); !strings.Contains(page, "forgot the failed record") {
		t.Fatalf("forget: %s", page)
	}
	if _, err := r.store.Inspect(context.Background(), skey); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("the record after forget: %v, want not found", err)
	}
	log := logged()
	for _, want := range []string{`action=replay`, `key=pay-1042 forget=true status=done`, `action=forget`, `status=refused`, `key=pay-2 fence=`} {
		if !strings.Contains(log, want) {
			t.Fatalf("the console's log has no %q:\n%s", want, log)
		}
	}
}

// TestConsoleReadOnly: with --read-only the console offers no action and
// refuses the actions' pages and POSTs.
func TestConsoleReadOnly(t *testing.T) {
	r := newRig(t, 1)
	r.publish("pay-1")
	r.waitOutcomes(amqpidem.DeadLettered, 1)
	base := r.startConsole(nil, "--listen", "127.0.0.1:0", "--read-only")
	b := newBrowser(t, base)
	if page := b.do("GET", "dlq?queue="+r.queue, nil, http.StatusOK); strings.Contains(page, "Replay…") || !strings.Contains(page, "read-only") {
		t.Fatalf("read-only dead letters page:\n%s", page)
	}
	b.do("GET", "replay?queue="+r.queue+"&key=pay-1&forget=1", nil, http.StatusForbidden)
	b.do("GET", "forget?endpoint="+r.queue+"&key=pay-1", nil, http.StatusForbidden)
	b.do("POST", "forget", url.Values{"endpoint": {hex.EncodeToString([]byte(r.queue))}}, http.StatusForbidden)
	if n := r.dlqLen(); n != 1 {
		t.Fatalf("the dead-letter queue holds %d, want 1", n)
	}
}
