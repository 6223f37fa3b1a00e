package demo

import (
	"bytes"
	"errors"
	"regexp"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// TestDialMalformedURLHidesPassword: an AMQP_URL whose password has an
// unescaped '%', '#' or '/' is refused, redacted, without amqp091-go's
// parse error, which quotes it.
func TestDialMalformedURLHidesPassword(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss"} {
		url := "amqp://guest:" + pass + "@127.0.0.1:1/"
		_, err := Dial(url, "test")
		t.Logf("%s: %v", pass, err)
		if err == nil {
			t.Fatalf("%s: Dial succeeded", pass)
		}
		msg := err.Error() + " " + redactURL(url)
		if strings.Contains(msg, pass) || strings.Contains(msg, `":p"`) {
			t.Errorf("%s: quotes the password: %s", pass, msg)
		}
	}
}

// TestLoggerEscapesControl checks that a hostile key or error text cannot
// reach the terminal through the examples' coloured logger: the only ESC
// bytes left are tint's own colour codes.
func TestLoggerEscapesControl(t *testing.T) {
	t.Setenv("FORCE_COLOR", "1")
	var b bytes.Buffer
	log := NewLogger(&b)
	log.Info("amqpidem: dead-lettered", "key", "pay\x1b]0;pwned\x07\r\x1b[2K", "error", errors.New("no\x1b[1A\x9b"),
		"outcome", "dead_lettered", "bytes", []byte("\x1b"), "plain", "café")
	colour := regexp.MustCompile(`\x1b\[[0-9;]*m`)
	rest := colour.ReplaceAllString(b.String(), "")
	for i, r := range strings.TrimSuffix(rest, "\n") {
		if unicode.IsControl(r) || r == utf8.RuneError {
			t.Fatalf("control character %q at %d reached the writer: %q", r, i, b.String())
		}
	}
	for _, want := range []string{`pay\x1b]0;pwned\a\r\x1b[2K`, `no\x1b[1A\x9b`, "café"} {
		if !strings.Contains(rest, want) {
			t.Errorf("%q not in %q", want, rest)
		}
	}
}
