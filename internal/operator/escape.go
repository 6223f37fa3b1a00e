package operator

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Escape is s safe to show on a terminal or in a page: every control
// character (C0 such as ESC, newline and tab, DEL, and C1 such as U+009B
// CSI), every bidirectional formatting character (U+202E and its kin,
// which reorder what follows them), the line and paragraph separators and
// every byte that is not UTF-8 are written as Go-style escapes (\n, \r, \t,
// \x1b, \u009b, \u202e; \xff for a stray byte). Printable UTF-8 and
// backslashes are kept as they are, so Escape(Escape(s)) == Escape(s); a
// value that itself holds a backslash escape reads the same as one holding
// the character. It does not escape HTML: a page still needs
// html/template's escaping on top.
func Escape(s string) string {
	if !needsEscape(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x80 && unsafeRune(r):
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// needsEscape reports whether Escape would change s.
func needsEscape(s string) bool {
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && size == 1) || unsafeRune(r) {
			return true
		}
		i += size
	}
	return false
}

// unsafeRune reports whether r must not be shown raw: a control character
// (C0, DEL, C1), a bidirectional formatting character, or a line or
// paragraph separator.
func unsafeRune(r rune) bool {
	return unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029'
}
