package amqpidem

import (
	"fmt"
	"log/slog"
	"strconv"
	"unicode"
	"unicode/utf8"
)

// EscapeControl is a slog.HandlerOptions ReplaceAttr (tint's too) for
// handlers that write string and error values as they are, as coloured
// console handlers such as tint do: a value holding a control character
// (ESC, CR, DEL, a C1 code) or invalid UTF-8 is replaced by its text with
// those escaped as Go does (\x1b, \r, \x9b), so that a key, an error or a
// reply-to taken from a hostile message and logged by amqpidem cannot
// drive the terminal (retitle it, erase lines, fake log lines). slog's
// own TextHandler and JSONHandler escape already.
func EscapeControl(_ []string, a slog.Attr) slog.Attr {
	v := a.Value.Resolve()
	var s string
	switch v.Kind() {
	case slog.KindString:
		s = v.String()
	case slog.KindAny:
		if err, ok := v.Any().(error); ok && err != nil {
			s = err.Error()
			break
		}
		if str, ok := v.Any().(fmt.Stringer); ok && str != nil {
			s = str.String()
			break
		}
		return a
	default:
		return a
	}
	if !hasControl(s) {
		return a
	}
	q := strconv.QuoteToGraphic(s)
	return slog.String(a.Key, q[1:len(q)-1])
}

// hasControl reports whether s holds a control character or invalid
// UTF-8.
func hasControl(s string) bool {
	for _, r := range s {
		if unicode.IsControl(r) || r == utf8.RuneError {
			return true
		}
	}
	return false
}
