package amqpidem_test

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// EscapeControl escapes control characters in string and error values
// and leaves every other value as it is.
func TestEscapeControl(t *testing.T) {
	var b bytes.Buffer
	// A handler that writes values raw, as tint does.
	raw := slog.New(slog.NewTextHandler(&b, &slog.HandlerOptions{ReplaceAttr: func(g []string, a slog.Attr) slog.Attr {
		a = amqpidem.EscapeControl(g, a)
		if a.Key == slog.MessageKey || a.Key == slog.TimeKey || a.Key == slog.LevelKey {
			return slog.Attr{}
		}
		return slog.String(a.Key, "<"+a.Value.String()+">")
	}}))
	raw.Info("m", "key", "k\x1b]0;x\x07\r", "error", errors.New("e\x9b"), "n", 5, "plain", "café")
	got := b.String()
	for _, want := range []string{`key=<k\x1b]0;x\a\r>`, `error=<e\x9b>`, "n=<5>", "plain=<café>"} {
		if !strings.Contains(got, want) {
			t.Errorf("%q not in %q", want, got)
		}
	}
}
