package main_test

import (
	"bufio"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// consoleToken is a token the tests give the console.
const consoleToken = "console-token-0123456789abcdef"

// startConsole runs "amqpidem console" with args and the rig's flags and
// env; it returns the URL it serves once it says so, and stops it (by its
// process id) when the test ends, checking that it exits with code 0.
func (r *rig) startConsole(env []string, args ...string) string {
	r.t.Helper()
	base, _ := r.startConsoleLog(env, args...)
	return base
}

// startConsoleLog is startConsole, also returning what the console has
// written to stderr so far, when called.
func (r *rig) startConsoleLog(env []string, args ...string) (string, func() string) {
	r.t.Helper()
	cmd := exec.Command(bin, append(append([]string{"console"}, args...), r.flags...)...)
	cmd.Env = append(append(os.Environ(), "AMQPIDEM_SIGNING_KEY="+rigSigningKey), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		r.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	served := make(chan string, 1)
	var mu sync.Mutex
	var log strings.Builder
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			mu.Lock()
			log.WriteString(sc.Text() + "\n")
			mu.Unlock()
			if _, rest, ok := strings.Cut(sc.Text(), "serving "); ok {
				served <- strings.Fields(rest)[0]
			}
		}
		io.Copy(io.Discard, stderr)
	}()
	logged := func() string {
		mu.Lock()
		defer mu.Unlock()
		return log.String()
	}
	r.t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		if err := cmd.Wait(); err != nil {
			r.t.Errorf("console after an interrupt: %v, want exit code 0", err)
		}
	})
	select {
	case u := <-served:
		return u, logged
	case <-time.After(30 * time.Second):
		r.t.Fatal("the console did not say where it serves within 30 s")
	}
	return "", logged
}

func status(t *testing.T, req *http.Request) int {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// TestConsoleRefusesNonLoopbackWithoutToken: the console will not serve
// an address other than the loopback interface's without a token, nor
// take a token too short, nor a --list-scan above its bound.
func TestConsoleRefusesNonLoopbackWithoutToken(t *testing.T) {
	r := newRig(t, 1)
	for _, listen := range []string{"0.0.0.0:0", ":0", "[::]:0", "192.0.2.1:0"} {
		_, errOut, code := r.cli("console", "--listen", listen)
		if code != 2 || !strings.Contains(errOut, "not a loopback address") || !strings.Contains(errOut, "AMQPIDEM_CONSOLE_TOKEN") {
			t.Fatalf("console --listen %s without a token: exit %d, stderr %q; want 2 and a refusal naming the token", listen, code, errOut)
		}
	}
	if _, errOut, code := r.cli("console", "--list-scan", "100001"); code != 2 || !strings.Contains(errOut, "ListScan 100001 is more than 100000") {
		t.Fatalf("console --list-scan 100001: exit %d, stderr %q; want 2 naming the bound", code, errOut)
	}
	cmd := exec.Command(bin, append([]string{"console", "--listen", "0.0.0.0:0"}, r.flags...)...)
	cmd.Env = append(os.Environ(), "AMQPIDEM_CONSOLE_TOKEN=short")
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), "at least 16") {
		t.Fatalf("console with a short token: %v, %s", err, out)
	}
}

// TestConsoleToken: with a token, a request without it, or with a wrong
// one, is refused (401, asking for basic auth), and one with it as a
// bearer token or a basic auth password gets the page.
func TestConsoleToken(t *testing.T) {
	r := newRig(t, 1)
	base := r.startConsole([]string{"AMQPIDEM_CONSOLE_TOKEN=" + consoleToken}, "--listen", "127.0.0.1:0", "--queue", r.queue)
	req := func(set func(*http.Request)) *http.Request {
		q, err := http.NewRequest(http.MethodGet, base, nil)
		if err != nil {
			t.Fatal(err)
		}
		set(q)
		return q
	}
	if got := status(t, req(func(*http.Request) {})); got != http.StatusUnauthorized {
		t.Fatalf("no token: %d, want 401", got)
	}
	if got := status(t, req(func(q *http.Request) { q.Header.Set("Authorization", "Bearer "+consoleToken+"x") })); got != http.StatusUnauthorized {
		t.Fatalf("a wrong token: %d, want 401", got)
	}
	if got := status(t, req(func(q *http.Request) { q.Header.Set("Authorization", "Bearer "+consoleToken) })); got != http.StatusOK {
		t.Fatalf("the bearer token: %d, want 200", got)
	}
	if got := status(t, req(func(q *http.Request) { q.SetBasicAuth("ops", consoleToken) })); got != http.StatusOK {
		t.Fatalf("the token as basic auth's password: %d, want 200", got)
	}
}

// TestConsoleServesRecords: without a token on the loopback interface, the
// console shows a failed record a real consumer made, and refuses a
// request naming another host (a DNS rebinding page).
func TestConsoleServesRecords(t *testing.T) {
	r := newRig(t, 1)
	r.publish("pay-1042")
	r.waitOutcomes(amqpidem.DeadLettered, 1)
	base := r.startConsole(nil, "--listen", "127.0.0.1:0", "--queue", r.queue)

	resp, err := http.Get(base + "key?endpoint=" + r.queue + "&key=pay-1042")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `class="state failed">failed<`) ||
		!strings.Contains(string(b), "card declined") {
		t.Fatalf("key page: %d\n%s", resp.StatusCode, b)
	}
	if strings.Contains(string(b), "guest:guest") {
		t.Fatalf("the broker's password on the page:\n%s", b)
	}
	resp, err = http.Get(base + "dlq?queue=" + r.queue)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `class="origin signed">signed<`) {
		t.Fatalf("dead letters page: %d\n%s", resp.StatusCode, b)
	}

	q, err := http.NewRequest(http.MethodGet, base, nil)
	if err != nil {
		t.Fatal(err)
	}
	q.Host = "attacker.example:8080"
	if got := status(t, q); got != http.StatusForbidden {
		t.Fatalf("a request naming another host: %d, want 403", got)
	}
}
