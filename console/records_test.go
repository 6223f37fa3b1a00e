package console_test

import (
	"context"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// records is what fill made in a store, by key.
type records map[string]lock.State

// leaseTTL is the lease TTL the records tests tell the console. fill's
// live leases are taken with it; its stalled ones with a third of it: a
// lease with TTL/3 left under a TTL of leaseTTL is what a lease last
// renewed 2/3 of the TTL ago looks like (the store keeps the deadline
// alone), which the console calls a stalled heartbeat.
const leaseTTL = 3 * time.Minute

// fill makes, for endpoint in s, completed records, failed ones (the
// first with the hostile key), live leases, stalled ones (live leases
// that look renewed longer than two heartbeat intervals ago under
// leaseTTL) and expired ones (leases left to expire), n of each kind as
// given; it returns their states, stalled ones as "stalled" and expired
// ones as "expired".
func fill(t *testing.T, s lock.Store, endpoint string, completed, failed, live, stalled, stale int) records {
	t.Helper()
	ctx := context.Background()
	out := records{}
	take := func(key string, ttl time.Duration) lock.Lease {
		res, err := s.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey(endpoint, key), TTL: ttl})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire(%q): %v %v", key, res.Status, err)
		}
		return res.Lease
	}
	for i := range completed {
		k := fmt.Sprintf("done-%03d", i)
		if err := s.Complete(ctx, take(k, time.Minute), []byte("ok")); err != nil {
			t.Fatal(err)
		}
		out[k] = lock.StateCompleted
	}
	for i := range failed {
		k := fmt.Sprintf("declined-%03d", i)
		if i == 0 {
			k = hostileKey
		}
		if err := s.Fail(ctx, take(k, time.Minute), "card declined <b>\x1b[31m"); err != nil {
			t.Fatal(err)
		}
		out[k] = lock.StateFailed
	}
	for i := range live {
		k := fmt.Sprintf("running-%03d", i)
		take(k, leaseTTL)
		out[k] = lock.StateInProgress
	}
	for i := range stalled {
		k := fmt.Sprintf("stalled-%03d", i)
		take(k, leaseTTL/3)
		out[k] = "stalled"
	}
	for i := range stale {
		k := fmt.Sprintf("expired-%03d", i)
		take(k, 20*time.Millisecond)
		out[k] = "expired"
	}
	time.Sleep(50 * time.Millisecond) // the expired leases expire
	return out
}

var (
	keyLink  = regexp.MustCompile(`<a href="key\?endpoint=[^"]*&amp;key=([^"]*)"><code>`)
	nextLink = regexp.MustCompile(`<a class="next" href="([^"]*)"`)
	scanned  = regexp.MustCompile(`<span class="scanned">(\d+)</span>`)
)

// listPages follows a records listing from path to its end and returns
// how many times each key was shown, checking each page's bound.
func listPages(t *testing.T, get func(string) string, path string, budget int) map[string]int {
	t.Helper()
	seen := map[string]int{}
	for pages := 0; path != ""; pages++ {
		if pages > 10000 {
			t.Fatalf("%s: no end", path)
		}
		page := get(path)
		noRaw(t, path, page)
		m := scanned.FindStringSubmatch(page)
		if m == nil {
			t.Fatalf("%s: no count of records read:\n%s", path, page)
		}
		if n, _ := strconv.Atoi(m[1]); n > 2*budget {
			t.Fatalf("%s: read %d records for a budget of %d", path, n, budget)
		}
		for _, k := range keyLink.FindAllStringSubmatch(page, -1) {
			key, err := unquery(k[1])
			if err != nil {
				t.Fatal(err)
			}
			seen[key]++
		}
		path = ""
		if m := nextLink.FindStringSubmatch(page); m != nil {
			path = "/" + html.UnescapeString(m[1])
		}
	}
	return seen
}

// unquery is a query value as a page's link carries it: HTML-escaped,
// percent-encoded.
func unquery(s string) (string, error) { return url.QueryUnescape(html.UnescapeString(s)) }

// TestConsoleRecords: the records pages of an endpoint, on Redis, list
// each record of the state asked once over their pages, each page reading
// at most about Config.ListScan records, the hostile key escaped; expired
// ones are the expired leases, stalled ones the live leases renewed more
// than two heartbeat intervals ago.
func TestConsoleRecords(t *testing.T) {
	endpoint := testenv.Name(t)
	store, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: "console-" + endpoint})
	if err != nil {
		t.Fatal(err)
	}
	want := fill(t, store, endpoint, 90, 7, 2, 2, 3)
	fill(t, store, endpoint+"-other", 10, 3, 0, 0, 0) // another endpoint's: never shown
	srv := serve(t, nil, console.Config{Admin: store, ListScan: 40, LeaseTTL: leaseTTL})
	var all strings.Builder // every page read
	getter := func(path string) string {
		p := get(t, srv, path, http.StatusOK)
		all.WriteString(p)
		return p
	}
	for _, filter := range []string{"failed", "expired", "stalled", "in_progress", "completed", ""} {
		seen := listPages(t, getter, "/records?endpoint="+endpoint+"&state="+filter, 40)
		n := 0
		for k, st := range want {
			match := filter == "" || string(st) == filter || (filter == "in_progress" && (st == "stalled" || st == "expired"))
			if !match {
				if seen[k] != 0 {
					t.Fatalf("state %q: %q (%s) shown", filter, k, st)
				}
				continue
			}
			n++
			if got, want := seen[k], 1; got != want {
				t.Fatalf("state %q: %q shown %d times, want %d", filter, k, got, want)
			}
		}
		if got, want := len(seen), n; got != want {
			t.Fatalf("state %q: %d keys shown, want %d", filter, got, want)
		}
	}
	// The hostile key was listed once (above), on a page without it raw
	// (noRaw), and errors are escaped.
	mustContain(t, "records pages", all.String(), "card declined &lt;b&gt;\\x1b[31m", "(lease expired)", "(heartbeat stalled)")
}

// TestConsoleOverviewCounts: the overview counts each queue's records by
// state, expired and stalled leases apart, each count linking to its
// records; the stalled and expired pages show how long ago each lease was
// renewed.
func TestConsoleOverviewCounts(t *testing.T) {
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	fill(t, store, "payments", 12, 4, 2, 1, 3)
	fill(t, store, "orders", 5, 1, 0, 0, 0)
	srv := serve(t, nil, console.Config{Admin: store, Queues: []string{"payments", "orders"}, LeaseTTL: leaseTTL})
	page := get(t, srv, "/", http.StatusOK)
	mustContain(t, "overview", page,
		`<a class="count failed" href="records?endpoint=payments&amp;state=failed">4</a>`,
		`<a class="count expired" href="records?endpoint=payments&amp;state=expired">3</a>`,
		`<a class="count stalled" href="records?endpoint=payments&amp;state=stalled">1</a>`,
		`<a href="records?endpoint=payments&amp;state=in_progress">2</a>`,
		`<a href="records?endpoint=payments&amp;state=completed">12</a>`,
		`<a class="count failed" href="records?endpoint=orders&amp;state=failed">1</a>`)
	noRaw(t, "overview", page)
	expiredPage := get(t, srv, "/records?endpoint=payments&state=expired", http.StatusOK)
	mustContain(t, "expired", expiredPage, "expired-000", "(lease expired)", "End of the listing.")
	stalledPage := get(t, srv, "/records?endpoint=payments&state=stalled", http.StatusOK)
	mustContain(t, "stalled", stalledPage, "stalled-000", "(heartbeat stalled)", "heartbeat stalled: renewed 2m0", "End of the listing.")
	for _, k := range []string{"running-000", "expired-000"} {
		if strings.Contains(stalledPage, k) {
			t.Fatalf("%s among the stalled:\n%s", k, stalledPage)
		}
	}
	if strings.Contains(expiredPage, "running-000") || strings.Contains(expiredPage, "stalled-000") {
		t.Fatalf("a live lease among the expired:\n%s", expiredPage)
	}
	running := get(t, srv, "/records?endpoint=payments&state=in_progress", http.StatusOK)
	mustContain(t, "in progress", running, "running-000", `<span class="renewed">renewed `)
}

// adminOnly is a lock.Admin that cannot list.
type adminOnly struct{ lock.Admin }

// TestConsoleRecordsBadInput: a records page without an endpoint, with a
// state that is none, with a cursor the store did not give, on a store
// that cannot list or is down, says what to do, with the status that fits.
func TestConsoleRecordsBadInput(t *testing.T) {
	store, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: "console-" + testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, nil, console.Config{Admin: store})
	for _, c := range []struct {
		path   string
		status int
		want   string
	}{
		{"/records", http.StatusBadRequest, "Which endpoint?"},
		{"/records?endpoint=e&state=done%3Cscript%3E", http.StatusBadRequest, "state &#34;done&lt;script&gt;&#34; is none of"},
		{"/records?endpoint=e&cursor=%3Cscript%3E", http.StatusBadRequest, "Start the listing again"},
	} {
		page := get(t, srv, c.path, c.status)
		mustContain(t, c.path, page, c.want, "What to do:")
		noRaw(t, c.path, page)
	}
	mustContain(t, "no lister", get(t, serve(t, nil, console.Config{Admin: adminOnly{store}}), "/records?endpoint=e", http.StatusNotImplemented),
		"cannot list", "What to do:")
	mustContain(t, "no store", get(t, serve(t, nil, console.Config{}), "/records?endpoint=e", http.StatusServiceUnavailable), "No store")
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { dead.Close() })
	deadStore, err := lock.NewRedisStore(dead, lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	down := serve(t, nil, console.Config{Admin: deadStore, StoreName: "Redis at 127.0.0.1:1", Queues: []string{"orders"}, Timeout: 5 * time.Second})
	page := get(t, down, "/records?endpoint=orders&state=failed", http.StatusServiceUnavailable)
	mustContain(t, "store down", page, "Redis at 127.0.0.1:1 did not answer", "Check that the store is up")
	mustContain(t, "overview, store down", get(t, down, "/", http.StatusOK), "Redis at 127.0.0.1:1: lock: list")
}

// TestLeaseHealth: how long ago a lease was renewed is the TTL less the
// time it has left; more than 2/3 of the TTL is a stalled heartbeat; an
// expired lease is expired, and a lease with more left than the TTL has no
// age.
func TestLeaseHealth(t *testing.T) {
	ttl := 30 * time.Second
	for _, c := range []struct {
		rec  lock.Record
		want string
	}{
		{lock.Record{State: lock.StateInProgress, LeaseLeft: 29 * time.Second}, "renewed 1s ago"},
		{lock.Record{State: lock.StateInProgress, LeaseLeft: 10 * time.Second}, "renewed 20s ago"},
		{lock.Record{State: lock.StateInProgress, LeaseLeft: 9900 * time.Millisecond}, "heartbeat stalled: renewed 20.1s ago"},
		{lock.Record{State: lock.StateInProgress, LeaseLeft: time.Second}, "heartbeat stalled: renewed 29s ago"},
		{lock.Record{State: lock.StateInProgress}, "expired"},
		{lock.Record{State: lock.StateInProgress, LeaseLeft: time.Minute}, ""},
		{lock.Record{State: lock.StateCompleted}, ""},
	} {
		if got := console.LeaseHealth(c.rec, ttl); got != c.want {
			t.Errorf("LeaseLeft %v, state %s: got %q, want %q", c.rec.LeaseLeft, c.rec.State, got, c.want)
		}
	}
}

// counter is a lock.Counter over a MemoryStore: it counts what a full
// listing gives, or fails with err.
type counter struct {
	*lock.MemoryStore
	err   error
	calls int
}

func (c *counter) Count(ctx context.Context, req lock.CountRequest) (lock.Counts, error) {
	c.calls++
	if c.err != nil {
		return lock.Counts{}, c.err
	}
	out := lock.Counts{States: map[lock.State]int{}}
	for cursor := ""; ; {
		page, err := c.List(ctx, lock.ListRequest{Prefix: req.Prefix, Cursor: cursor, Scan: lock.MaxListScan})
		if err != nil {
			return lock.Counts{}, err
		}
		for _, r := range page.Records {
			out.States[r.State]++
			switch {
			case r.State == lock.StateInProgress && !r.Live():
				out.Expired++
			case r.Live() && r.LeaseLeft < req.LeaseBelow:
				out.LeaseBelow++
			}
		}
		if cursor = page.Next; cursor == "" {
			return out, nil
		}
	}
}

// TestConsoleOverviewExactOrAtLeast: the overview shows a Counter's
// counts as exact; when the count fails over its budget, or the store
// cannot count, it counts among a page, exact when the page held every
// record and "at least" when it did not.
func TestConsoleOverviewExactOrAtLeast(t *testing.T) {
	small, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	fill(t, small, "payments", 12, 4, 2, 1, 3)
	big, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	fill(t, big, "shipments", 1100, 0, 0, 0, 0) // more than a page of 1000
	overview := func(admin lock.Admin, queue string) string {
		return get(t, serve(t, nil, console.Config{Admin: admin, Queues: []string{queue}, LeaseTTL: leaseTTL}), "/", http.StatusOK)
	}
	page := overview(&counter{MemoryStore: small}, "payments")
	mustContain(t, "exact", page, "exact: 22 records",
		`<a class="count stalled" href="records?endpoint=payments&amp;state=stalled">1</a>`,
		`<a class="count expired" href="records?endpoint=payments&amp;state=expired">3</a>`,
		`<a href="records?endpoint=payments&amp;state=in_progress">2</a>`)
	page = overview(&counter{MemoryStore: big}, "shipments")
	mustContain(t, "exact", page, "exact: 1100 records", `<a href="records?endpoint=shipments&amp;state=completed">1100</a>`)
	if strings.Contains(page, "at least <a") {
		t.Fatalf("exact counts marked at least:\n%s", page)
	}
	over := fmt.Errorf("count: %w", lock.ErrCountBudget)
	page = overview(&counter{MemoryStore: small, err: over}, "payments")
	mustContain(t, "over budget, one page", page, "the store&#39;s count took more than its 100ms budget", "exact: all 22 records read")
	if strings.Contains(page, "at least <a") {
		t.Fatalf("the counts of a page holding every record marked at least:\n%s", page)
	}
	page = overview(&counter{MemoryStore: big, err: over}, "shipments")
	mustContain(t, "over budget, more than a page", page, "took more than its 100ms budget",
		"among the first 1000 records read (more not read)",
		`at least <a href="records?endpoint=shipments&amp;state=completed">1000</a>`)
	page = overview(big, "shipments") // no Counter
	mustContain(t, "no counter", page, `at least <a href="records?endpoint=shipments&amp;state=completed">1000</a>`)
	if strings.Contains(page, "took more than") {
		t.Fatalf("a store without a count said to be over budget:\n%s", page)
	}
}

// stingy is a store whose List calls read at most 300 records each,
// however many are asked for, as a Redis SCAN step over the keys of other
// endpoints reads fewer (none, at times).
type stingy struct{ *lock.MemoryStore }

func (s stingy) List(ctx context.Context, req lock.ListRequest) (lock.ListPage, error) {
	req.Scan = min(req.Scan, 300)
	return s.MemoryStore.List(ctx, req)
}

// TestConsoleOverviewReadsOnAfterShortPages: the overview follows the
// store's cursor until it read a page's worth of records (1000), not
// counting among what the first List call happened to read.
func TestConsoleOverviewReadsOnAfterShortPages(t *testing.T) {
	big, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	fill(t, big, "shipments", 1100, 0, 0, 0, 0)
	page := get(t, serve(t, nil, console.Config{Admin: stingy{big}, Queues: []string{"shipments"}, LeaseTTL: leaseTTL}), "/", http.StatusOK)
	mustContain(t, "short pages", page, "among the first 1000 records read (more not read)",
		`at least <a href="records?endpoint=shipments&amp;state=completed">1000</a>`)
}
