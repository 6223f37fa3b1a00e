package main_test

import (
	"bufio"
	"context"
	"io"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// serveConsole runs "amqpidem console" with args until the test ends
// (stopped by its process id, exit code 0 checked) and returns its URL.
func serveConsole(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"console", "--listen", "127.0.0.1:0"}, args...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
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
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		if err := cmd.Wait(); err != nil {
			t.Errorf("console after an interrupt: %v, want exit code 0", err)
		}
	})
	select {
	case u := <-served:
		return u
	case <-time.After(30 * time.Second):
		t.Fatal("the console did not say where it serves within 30 s")
	}
	return ""
}

// TestConsoleRelayRedrive: "amqpidem console --postgres" shows the
// outbox's dead rows and backlog, and redrives a dead row by relay
// redrive's rules after its confirmation page: the row is pending again,
// and a second redrive of it is refused (not dead), as the command
// refuses it.
func TestConsoleRelayRedrive(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	ctx := context.Background()
	cfg, ob := outboxSchema(t, pool)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"nowhere-1", "nowhere-2"} {
		if _, err := ob.Write(ctx, tx, pgstore.Message{Exchange: "no-such-exchange", RoutingKey: key, Publishing: amqp.Publishing{Body: []byte(key)}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// The first row dead, as a relay leaves a row the broker refused.
	table := pgx.Identifier{cfg.Schema, "amqpidem_outbox"}.Sanitize()
	var id int64
	if err := pool.QueryRow(ctx, "UPDATE "+table+" SET state = 'd', attempts = 10 WHERE id = (SELECT min(id) FROM "+table+") RETURNING id").Scan(&id); err != nil {
		t.Fatal(err)
	}
	base := serveConsole(t, "--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema, "--amqp", testenv.AMQPURL(t))
	b := newBrowser(t, strings.TrimSuffix(base, "/"))
	ov := b.do("GET", "/", nil, 200)
	for _, want := range []string{`<a href="relay?state=pending">1</a>`, `<a class="count dead" href="relay?state=dead">1</a>`, "outbox " + cfg.Schema + ".amqpidem_outbox"} {
		if !strings.Contains(ov, want) {
			t.Fatalf("overview: no %q in:\n%s", want, ov)
		}
	}
	if strings.Contains(ov, pgenv.DSN(t)) {
		t.Fatalf("the DSN on the page:\n%s", ov)
	}
	sid := strconv.FormatInt(id, 10)
	dead := b.do("GET", "/relay?state=dead", nil, 200)
	if !strings.Contains(dead, `href="redrive?id=`+sid+`"`) || !strings.Contains(dead, "nowhere-1") {
		t.Fatalf("dead rows page:\n%s", dead)
	}
	confirm := b.do("GET", "/redrive?id="+sid, nil, 200)
	if !strings.Contains(confirm, "1 dead row of "+cfg.Schema+".amqpidem_outbox would be pending again") {
		t.Fatalf("confirmation without relay redrive's dry run:\n%s", confirm)
	}
	form := url.Values{}
	for _, m := range hiddenInput.FindAllStringSubmatch(confirm, -1) {
		form.Set(m[1], m[2])
	}
	res := b.do("POST", "/redrive", form, 200)
	if !strings.Contains(res, "1 dead row pending again") {
		t.Fatalf("redrive result:\n%s", res)
	}
	n, _, err := ob.Backlog(ctx)
	if err != nil || n != 2 {
		t.Fatalf("pending rows after the redrive: %d (%v), want 2", n, err)
	}
	// Not dead now: the dry run refuses, as relay redrive exits 3.
	again := b.do("GET", "/redrive?id="+sid, nil, 200)
	if !strings.Contains(again, "Nothing to confirm") || !strings.Contains(again, "no dead row to re-drive") {
		t.Fatalf("redrive of a row no longer dead:\n%s", again)
	}
}
