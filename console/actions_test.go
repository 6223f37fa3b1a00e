package console_test

import (
	"context"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/amqpidem/amqpidem/console"
)

// recorded is an Actions that carries out nothing and records what it was
// asked: the console's own refusals are under test here (the command's
// actions are tested in cmd/amqpidem).
type recorded struct {
	mu      sync.Mutex
	forgets []console.ForgetRequest
	replays []console.ReplayRequest
}

func (a *recorded) Forget(_ context.Context, req console.ForgetRequest) console.Outcome {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.forgets = append(a.forgets, req)
	return console.Outcome{Status: console.Done, Report: "forget " + req.Key + "\x1b[2J<i>"}
}

func (a *recorded) Replay(_ context.Context, req console.ReplayRequest) console.Outcome {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.replays = append(a.replays, req)
	return console.Outcome{Status: console.Done, Report: "replay " + req.Key}
}

// real counts the requests that were not dry runs.
func (a *recorded) real() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, f := range a.forgets {
		if !f.DryRun {
			n++
		}
	}
	for _, r := range a.replays {
		if !r.DryRun {
			n++
		}
	}
	return n
}

// post posts form to srv's path with client c and extra headers; it
// returns the status and page.
func post(t *testing.T, c *http.Client, srv string, path string, form url.Values, headers map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv+path, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestConsoleCSRF: a confirmed action is carried out only for a POST with
// the token of the confirmation page, in the browser that got it, from
// the console's own origin; the confirmation page of a hostile key shows
// it escaped and carries it only hex-encoded.
func TestConsoleCSRF(t *testing.T) {
	s := seed(t, hostileKey)
	acts := &recorded{}
	srv := serve(t, s, console.Config{Actions: acts, SigningKey: []byte(signingKey)})
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}

	resp, err := c.Get(srv.URL + "/forget?endpoint=" + url.QueryEscape(s.queue) + "&key=" + url.QueryEscape(hostileKey))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	page := string(b)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("forget confirmation: %d\n%s", resp.StatusCode, page)
	}
	noRaw(t, "forget confirmation", page)
	mustContain(t, "forget confirmation", page, "Forget the failed record of &lt;script&gt;", `\x1b[2J&lt;i&gt;`, `action="forget"`)
	form := url.Values{}
	for _, m := range regexp.MustCompile(`name="(\w+)" value="([0-9a-f]*)"`).FindAllStringSubmatch(page, -1) {
		form.Set(m[1], m[2])
	}
	if form.Get("csrf") == "" || form.Get("key") == "" {
		t.Fatalf("no token or key in the form:\n%s", page)
	}

	noToken := url.Values{"endpoint": form["endpoint"], "key": form["key"], "fence": form["fence"]}
	wrongToken := url.Values{"endpoint": form["endpoint"], "key": form["key"], "fence": form["fence"], "csrf": {strings.Repeat("ab", 32)}}
	for _, tc := range []struct {
		what    string
		client  *http.Client
		form    url.Values
		headers map[string]string
	}{
		{"no token", c, noToken, nil},
		{"a wrong token", c, wrongToken, nil},
		{"the token without its cookie (another browser)", http.DefaultClient, form, nil},
		{"a cross-site request", c, form, map[string]string{"Sec-Fetch-Site": "cross-site"}},
		{"another origin", c, form, map[string]string{"Origin": "https://attacker.example"}},
	} {
		status, page := post(t, tc.client, srv.URL, "/forget", tc.form, tc.headers)
		if status != http.StatusForbidden || !strings.Contains(page, "nothing was changed") {
			t.Fatalf("%s: %d, want 403 saying nothing changed:\n%s", tc.what, status, page)
		}
	}
	if n := acts.real(); n != 0 {
		t.Fatalf("%d actions carried out on refused POSTs", n)
	}
	status, page := post(t, c, srv.URL, "/forget", form, nil)
	if status != http.StatusOK {
		t.Fatalf("the confirmed POST: %d\n%s", status, page)
	}
	noRaw(t, "forget result", page)
	acts.mu.Lock()
	last := acts.forgets[len(acts.forgets)-1]
	acts.mu.Unlock()
	if last.DryRun || last.Key != hostileKey || last.Endpoint != s.queue || last.Fence == 0 {
		t.Fatalf("the confirmed forget asked %+v, want the hostile key's, fenced, not a dry run", last)
	}

	// Read-only: no action page, no POST.
	ro := serve(t, s, console.Config{})
	get(t, ro, "/forget?endpoint="+url.QueryEscape(s.queue)+"&key=k", http.StatusForbidden)
	if status, _ := post(t, http.DefaultClient, ro.URL, "/replay", form, nil); status != http.StatusForbidden {
		t.Fatalf("POST to a read-only console: %d, want 403", status)
	}
}
