package main

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"
)

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table writes rows as aligned columns.
func table(w io.Writer, rows [][]string) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	tw.Flush()
}

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

// oneLine makes s fit a table cell: newlines and tabs as spaces, at most n
// runes.
func oneLine(s string, n int) string {
	s = strings.Map(func(r rune) rune {
		if r == '\n' || r == '\r' || r == '\t' {
			return ' '
		}
		return r
	}, s)
	if utf8.RuneCountInString(s) > n {
		r := []rune(s)
		s = string(r[:n-1]) + "…"
	}
	return s
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

// redactURL hides the password of a URL, for messages.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
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
