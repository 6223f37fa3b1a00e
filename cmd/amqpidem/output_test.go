package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/amqpidem/amqpidem/lock"
)

// checkTerminalSafe fails unless out is UTF-8 without a control character
// other than the newlines ending lines, a bidirectional formatting
// character or a line or paragraph separator: what a terminal may be
// given.
func checkTerminalSafe(t *testing.T, what string, out []byte) {
	t.Helper()
	if !utf8.Valid(out) {
		t.Fatalf("%s: not UTF-8:\n%q", what, out)
	}
	for i, r := range string(out) {
		if r != '\n' && (unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029') {
			t.Fatalf("%s: raw %U at byte %d:\n%q", what, r, i, out)
		}
	}
}

func TestEscapeText(t *testing.T) {
	for in, want := range map[string]string{
		"order-1042":              "order-1042",
		"café ☕ 注文 👩‍💻":           "café ☕ 注文 👩‍💻", // printable UTF-8 (ZWJ included) kept
		"a\nb\r\tc":               `a\nb\r\tc`,
		"\x1b]0;pwned\x07\x1b[2K": `\x1b]0;pwned\x07\x1b[2K`,
		"\x00\x7f":                `\x00\x7f`,
		"\u009b2J\u0085":          `\u009b2J\u0085`,
		"\u202eabc\u2066\u200f":   `\u202eabc\u2066\u200f`,
		"line\u2028para\u2029":    `line\u2028para\u2029`,
		"bad\xff\xc3":             `bad\xff\xc3`,
		`already \x1b escaped`:    `already \x1b escaped`,
	} {
		if got := escapeText(in); got != want {
			t.Errorf("escapeText(%q) = %q, want %q", in, got, want)
		}
	}
}

// A table cell with a newline or a tab adds neither a row nor a column.
func TestTableEscapesCells(t *testing.T) {
	var b bytes.Buffer
	table(&b, [][]string{{"A", "B"}, {"x\ny\tz", "\x1b[31mred"}})
	checkTerminalSafe(t, "table", b.Bytes())
	if got := strings.Count(b.String(), "\n"); got != 2 {
		t.Fatalf("table: %d lines, want 2:\n%s", got, b.String())
	}
}

// renderText writes the text output of dlq list and inspect (a completed
// and a failed record) made of the values given: every path from a value
// that a publisher, a handler or a store chose to the terminal.
func renderText(key, reason, errText, exchange, routingKey, result, owner string) []byte {
	var b bytes.Buffer
	first := time.Unix(1700000000, 0).UTC()
	printDeadLetters(&b, "orders.dlq", 3, []deadLetter{
		{Index: 1, Key: key, Reason: reason, Error: errText, Attempts: 2, FirstSeen: &first,
			OriginalExchange: exchange, OriginalRoutingKey: routingKey},
		{Index: 2, Key: "", Reason: reason},
	})
	o := &options{stdout: &b}
	k := &keyFlags{queue: "orders"}
	_ = o.printRecord(k, key, lock.Record{Key: key, State: lock.StateCompleted, Owner: owner, Attempts: 1,
		Value: []byte(result), Location: "redis key " + key}, 64)
	_ = o.printRecord(k, key, lock.Record{Key: key, State: lock.StateFailed, Owner: owner, Error: errText,
		LeaseLeft: time.Second, Location: routingKey}, 1024)
	return b.Bytes()
}

// FuzzTextOutput: whatever the values of a dead letter or a record, the
// text output of dlq list and inspect gives the terminal no control
// character (but the newlines ending its lines), no bidi override, and
// only UTF-8; escapeText is idempotent.
func FuzzTextOutput(f *testing.F) {
	f.Add("order-1", "permanent failure", "card declined", "", "orders", `{"receipt":"r-1"}`, "owner-1")
	f.Add("evil\x1b]0;pwned\x07", "x\u009b2J", "e\r\n\x1b[1A", "ex\u202e", "rk\n9  fake", "res\x1b[2K\x00", "o\x7f")
	f.Add("\xff\xfe", "\u2028", "\t", "\u0085", "\u061c", "\xc3", "é👩‍💻")
	f.Fuzz(func(t *testing.T, key, reason, errText, exchange, routingKey, result, owner string) {
		checkTerminalSafe(t, "text output", renderText(key, reason, errText, exchange, routingKey, result, owner))
		for _, s := range []string{key, result} {
			once := escapeText(s)
			if twice := escapeText(once); twice != once {
				t.Fatalf("escapeText not idempotent on %q: %q then %q", s, once, twice)
			}
		}
	})
}
