package main_test

import (
	"context"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// hostileKey sets the terminal's title (OSC), moves the cursor up and
// erases the line (CSI, 7-bit and C1), and reverses the text after it
// (bidi override), when printed raw.
const hostileKey = "evil\x1b]0;pwned\x07\x1b[1A\x1b[2K\u009b2J\u202eX\x7f"

// rawControl is the first control character, bidi override or invalid byte
// in s, with its offset; ok is false when there is none. Newlines end
// lines and are allowed; nothing else is.
func rawControl(s string) (at int, r rune, ok bool) {
	for i, r := range s {
		switch {
		case r == '\n':
		case r == utf8.RuneError:
			return i, r, true
		case unicode.IsControl(r), unicode.Is(unicode.Bidi_Control, r), r == '\u2028', r == '\u2029':
			return i, r, true
		}
	}
	return 0, 0, false
}

func noRawControl(t *testing.T, what, out string) {
	t.Helper()
	if at, r, ok := rawControl(out); ok {
		t.Fatalf("%s: raw %U at byte %d reaches the terminal:\n%q", what, r, at, out)
	}
}

// A dead letter whose key, routing key and stored result carry escape
// sequences is shown with them escaped by dlq list and inspect: nothing
// reaches the terminal raw, and no line is added to a table.
func TestTextOutputEscapesControlBytes(t *testing.T) {
	r := newRig(t, 2)
	err := r.pub.Publish(context.Background(), "", r.queue, amqp.Publishing{MessageId: hostileKey, Body: []byte("pay"),
		Headers: amqp.Table{amqpidem.HeaderOriginalExchange: "", amqpidem.HeaderOriginalRoutingKey: "rk\n9  fake-row\x1b[31m"}})
	if err != nil {
		t.Fatal(err)
	}
	r.waitOutcomes(amqpidem.DeadLettered, 1)

	out, errOut, code := r.cli("dlq", "list", r.queue)
	if code != 0 {
		t.Fatalf("dlq list: exit %d\n%s", code, errOut)
	}
	noRawControl(t, "dlq list", out)
	noRawControl(t, "dlq list stderr", errOut)
	if !strings.Contains(out, `evil\x1b]0;pwned\x07`) || !strings.Contains(out, `\u202e`) {
		t.Fatalf("dlq list does not show the key escaped:\n%s", out)
	}
	if n := strings.Count(out, "\n"); n != 3 { // the count, the header, one row
		t.Fatalf("dlq list: %d lines, want 3:\n%s", n, out)
	}

	r.broken.Store(false)
	r.mustCLI(0, "dlq", "replay", r.queue, "--all", "--forget", "--yes")
	r.waitOutcomes(amqpidem.Completed, 1)
	out = r.mustCLI(0, "inspect", hostileKey, "--queue", r.queue)
	noRawControl(t, "inspect", out)
	if !strings.Contains(out, `rcpt-evil\x1b]0;pwned\x07`) {
		t.Fatalf("inspect does not show the stored result escaped:\n%s", out)
	}
	out = r.mustCLI(0, "forget", hostileKey, "--queue", r.queue)
	noRawControl(t, "forget", out)
}
