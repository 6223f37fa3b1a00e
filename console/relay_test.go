package console_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/console"
)

// fakeRelay is an outbox of rows in memory; down makes every call fail.
type fakeRelay struct {
	dead, pending []console.RelayRow
	down          error
}

func (f *fakeRelay) Backlog(context.Context) (int64, time.Duration, error) {
	return int64(len(f.pending)), 90 * time.Second, f.down
}

func (f *fakeRelay) Dead(context.Context) (int64, error) { return int64(len(f.dead)), f.down }

func (f *fakeRelay) Rows(_ context.Context, state string, after int64, limit int) ([]console.RelayRow, error) {
	if f.down != nil {
		return nil, f.down
	}
	rows := f.dead
	if state == "pending" {
		rows = f.pending
	}
	var out []console.RelayRow
	for _, r := range rows {
		if r.ID > after && len(out) < limit {
			out = append(out, r)
		}
	}
	return out, nil
}

// redriving is a recorded that redrives too.
type redriving struct {
	recorded
	mu       sync.Mutex
	redrives []console.RedriveRequest
}

func (a *redriving) Redrive(_ context.Context, req console.RedriveRequest) console.Outcome {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.redrives = append(a.redrives, req)
	if req.ID == 999 {
		return console.Outcome{Status: console.Refused, Report: "not dead, left as it was: 999"}
	}
	return console.Outcome{Status: console.Done, Report: fmt.Sprintf("1 dead row pending again (%d)", req.ID)}
}

func (a *redriving) confirmed() []console.RedriveRequest {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []console.RedriveRequest
	for _, r := range a.redrives {
		if !r.DryRun {
			out = append(out, r)
		}
	}
	return out
}

func relayRows(n int, state string) []console.RelayRow {
	rows := make([]console.RelayRow, n)
	for i := range rows {
		rows[i] = console.RelayRow{ID: int64(i + 1), MessageID: fmt.Sprintf("%s-%d", state, i+1), Exchange: "billing",
			RoutingKey: "invoice\x1b[2J<b>", Attempts: 10, LastError: "NO_ROUTE <script>", CreatedAt: time.Now()}
	}
	return rows
}

// TestConsoleRelay: the overview shows the outbox's backlog; the relay
// page lists dead and pending rows page by page, escaped; a dead row is
// redriven only by a POST with the confirmation page's token, and the
// read-only console offers no redrive.
func TestConsoleRelay(t *testing.T) {
	rel := &fakeRelay{dead: relayRows(60, "dead"), pending: relayRows(3, "pending")}
	acts := &redriving{}
	srv := serve(t, nil, console.Config{Relay: rel, RelayName: "outbox public.amqpidem_outbox", Actions: acts})
	ov := get(t, srv, "/", http.StatusOK)
	mustContain(t, "overview", ov, `<a href="relay?state=pending">3</a>`, `<td>1m30s</td>`, `<a class="count dead" href="relay?state=dead">60</a>`)

	page := get(t, srv, "/relay?state=dead", http.StatusOK)
	noRaw(t, "relay", page)
	mustContain(t, "relay dead", page, "dead-1<", "dead-50<", `invoice\x1b[2J&lt;b&gt;`, "NO_ROUTE &lt;script&gt;", `href="redrive?id=7"`,
		`<a class="next" href="relay?after=50&amp;state=dead">`)
	if strings.Contains(page, "dead-51<") {
		t.Fatalf("more than a page of rows:\n%s", page)
	}
	mustContain(t, "relay dead, page 2", get(t, srv, "/relay?state=dead&after=50", http.StatusOK), "dead-51<", "dead-60<")
	pend := get(t, srv, "/relay?state=pending", http.StatusOK)
	mustContain(t, "relay pending", pend, "pending-3<")
	if strings.Contains(pend, "redrive?id=") {
		t.Fatalf("redrive offered for a pending row:\n%s", pend)
	}

	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	resp, err := c.Get(srv.URL + "/redrive?id=7")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("redrive confirmation: %d\n%s", resp.StatusCode, b)
	}
	mustContain(t, "redrive confirmation", string(b), "Make dead row 7 pending again?", "1 dead row pending again (7)", `action="redrive"`)
	form := url.Values{}
	for _, m := range regexp.MustCompile(`name="(\w+)" value="([0-9a-f]*)"`).FindAllStringSubmatch(string(b), -1) {
		form.Set(m[1], m[2])
	}
	if status, page := post(t, c, srv.URL, "/redrive", url.Values{"id": form["id"]}, nil); status != http.StatusForbidden {
		t.Fatalf("POST without the token: %d, want 403\n%s", status, page)
	}
	if n := len(acts.confirmed()); n != 0 {
		t.Fatalf("%d redrives on a refused POST", n)
	}
	status, res := post(t, c, srv.URL, "/redrive", form, nil)
	if status != http.StatusOK || !strings.Contains(res, "Redrive row 7: done") {
		t.Fatalf("confirmed redrive: %d\n%s", status, res)
	}
	if got := acts.confirmed(); len(got) != 1 || got[0].ID != 7 {
		t.Fatalf("redrives carried out: %+v, want row 7 once", got)
	}
	// A row that is not dead: the dry run refuses, nothing to confirm.
	mustContain(t, "redrive of a row not dead", get(t, srv, "/redrive?id=999", http.StatusOK), "not dead, left as it was", "Nothing to confirm")

	ro := serve(t, nil, console.Config{Relay: rel})
	if strings.Contains(get(t, ro, "/relay", http.StatusOK), "redrive?id=") {
		t.Fatal("a read-only console offers redrive")
	}
	get(t, ro, "/redrive?id=7", http.StatusForbidden)
	if status, _ := post(t, c, ro.URL, "/redrive", form, nil); status != http.StatusForbidden {
		t.Fatalf("POST to a read-only console: %d, want 403", status)
	}
}

// TestConsoleRelayBadInput: a bad state, row ID or cursor, no outbox, or
// an outbox down, each give a page saying what to do.
func TestConsoleRelayBadInput(t *testing.T) {
	srv := serve(t, nil, console.Config{Relay: &fakeRelay{}, Actions: &redriving{}})
	for _, c := range []struct {
		path   string
		status int
		want   string
	}{
		{"/relay?state=sent%3Cb%3E", http.StatusBadRequest, "neither dead nor pending"},
		{"/relay?after=-1", http.StatusBadRequest, "not a row ID"},
		{"/redrive?id=x%3Cscript%3E", http.StatusBadRequest, "not an outbox row ID"},
		{"/redrive", http.StatusBadRequest, "not an outbox row ID"},
	} {
		page := get(t, srv, c.path, c.status)
		mustContain(t, c.path, page, c.want, "What to do:")
		noRaw(t, c.path, page)
	}
	mustContain(t, "no outbox", get(t, serve(t, nil, console.Config{}), "/relay", http.StatusServiceUnavailable), "No outbox")
	down := serve(t, nil, console.Config{Relay: &fakeRelay{down: errors.New("dial tcp 127.0.0.1:1: connection refused")}, RelayName: "outbox t"})
	mustContain(t, "outbox down", get(t, down, "/relay", http.StatusServiceUnavailable), "outbox t did not answer", "Check that PostgreSQL is up")
	mustContain(t, "overview, outbox down", get(t, down, "/", http.StatusOK), "Backlog unknown: outbox t: dial tcp")
}
