package main

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/amqpidem/amqpidem/internal/operator"
)

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table writes rows as aligned columns. Every cell goes through
// escapeText, so no cell can add a line or a column, or reach the terminal
// with a control character.
func table(w io.Writer, rows [][]string) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	cells := make([]string, 0, 8)
	for _, r := range rows {
		cells = cells[:0]
		for _, c := range r {
			cells = append(cells, escapeText(c))
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	tw.Flush()
}

// escapeText is s safe to print on a terminal: operator.Escape, which the
// console uses too. Every control character, bidi formatting character,
// line or paragraph separator and byte that is not UTF-8 is written as a
// Go-style escape; escapeText(escapeText(s)) == escapeText(s). All the
// text output of the CLI that can hold a value from a message, a record or
// a store goes through it; --json output is escaped by encoding/json.
func escapeText(s string) string { return operator.Escape(s) }

// shown is b as text for a person or a script: the text when it is UTF-8,
// else hex prefixed "0x"; cut to max bytes. It reports whether it was cut.
func shown(b []byte, max int) (string, bool) {
	cut := len(b) > max
	if cut {
		b = b[:max]
	}
	if utf8.Valid(b) {
		return string(b), cut
	}
	return "0x" + hex.EncodeToString(b), cut
}

// oneLine makes s fit a table cell: at most n runes of it, then escaped
// (escapeText: newlines, tabs and every other control character as
// escapes), so that an escape is never cut.
func oneLine(s string, n int) string {
	if utf8.RuneCountInString(s) > n {
		r := []rune(s)
		s = string(r[:n-1]) + "…"
	}
	return escapeText(s)
}

// when formats a time for people: UTC, to the millisecond; "-" when zero.
func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02T15:04:05.000Z")
}

// timePtr is nil for a zero time, for JSON's omitempty.
func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC()
	return &t
}

// progress draws "verb n/total" on one terminal line; a no-op when off.
type progress struct {
	w     io.Writer
	on    bool
	verb  string
	total int
	last  time.Time
}

func (p *progress) step(n int) {
	if !p.on || (n < p.total && time.Since(p.last) < 100*time.Millisecond) {
		return
	}
	p.last = time.Now()
	const width = 30
	done := width
	if p.total > 0 {
		done = width * n / p.total
	}
	fmt.Fprintf(p.w, "\r%s [%s%s] %d/%d", p.verb, strings.Repeat("=", done), strings.Repeat(" ", width-done), n, p.total)
}

// end ends the progress line.
func (p *progress) end() {
	if p.on {
		fmt.Fprintln(p.w)
	}
}
