// Package secret keeps credentials out of what amqpidem prints: the URLs
// and DSNs of the broker and the stores, and the errors of parsing them.
//
// A URL that does not parse is the dangerous case: the parsers' errors
// quote the URL, or the piece of it they stumbled on, and that is most
// often the password (an unescaped '%', '#', '/' or '@' in it). So the
// functions here never print a parser's error text, only their own
// explanation and the redacted URL.
package secret

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// Mask replaces a password in what the functions here return.
const Mask = "xxxxx"

// URL returns s with the password of its user information replaced by
// Mask, whether or not s parses: the user information is everything
// between "://" and the last '@', so that a password with an unescaped
// '/', '#', '?' or '@' is hidden whole. The user name is kept. The value
// of a password query parameter (pgx takes one) is hidden too. Text
// without "://" is returned as DSN returns it.
func URL(s string) string {
	i := strings.Index(s, "://")
	if i < 0 {
		return DSN(s)
	}
	rest := s[i+3:]
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		user, _, hasPass := strings.Cut(rest[:at], ":")
		switch {
		case hasPass:
			user += ":" + Mask
		case strings.ContainsAny(user, "%#/?"):
			// The URL's parsers take it for a user name; some tools
			// for a password: hide it when it does not look like a name.
			user = Mask
		}
		rest = user + "@" + rest[at+1:]
	}
	return s[:i+3] + hideQueryPassword(rest)
}

// hideQueryPassword hides the values of the password parameters of the
// query in rest, a URL after its "://".
func hideQueryPassword(rest string) string {
	q := strings.IndexByte(rest, '?')
	if q < 0 {
		return rest
	}
	params := strings.Split(rest[q+1:], "&")
	for i, p := range params {
		if k, _, ok := strings.Cut(p, "="); ok && strings.EqualFold(k, "password") {
			params[i] = k + "=" + Mask
		}
	}
	return rest[:q+1] + strings.Join(params, "&")
}

// DSN returns a PostgreSQL connection string with its password hidden:
// a URL's as URL does, and in the keyword/value form the value of
// password (quoted or not).
func DSN(s string) string {
	if strings.Contains(s, "://") {
		return URL(s)
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		// A keyword: up to '=' (spaces around it allowed).
		j := strings.IndexByte(s[i:], '=')
		if j < 0 {
			b.WriteString(s[i:])
			break
		}
		key := strings.TrimSpace(s[i : i+j])
		b.WriteString(s[i : i+j+1])
		i += j + 1
		for i < len(s) && s[i] == ' ' {
			b.WriteByte(' ')
			i++
		}
		// Its value: quoted with '' and \ escapes, or up to a space.
		end := i
		if end < len(s) && s[end] == '\'' {
			end++
			for end < len(s) && s[end] != '\'' {
				if s[end] == '\\' {
					end++
				}
				end++
			}
			end = min(end+1, len(s))
		} else {
			for end < len(s) && s[end] != ' ' {
				if s[end] == '\\' {
					end++
				}
				end++
			}
			end = min(end, len(s))
		}
		if strings.EqualFold(key, "password") {
			b.WriteString(Mask)
		} else {
			b.WriteString(s[i:end])
		}
		i = end
	}
	return b.String()
}

// ParseError is the error of a URL that does not parse, naming it
// redacted (URL) and saying what is wrong without the parser's own text,
// which may quote the password. what names where the URL came from
// (ConsumerConfig.URL, --amqp); s is the URL, "" when unknown (then the
// error names none); err is the parser's error, which ParseError neither
// prints nor wraps.
func ParseError(what, s string, err error) error {
	why := "it does not parse: percent-encode a reserved character ('%', '/', '#', '?', '@', ':') in the user name or password"
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	var esc url.EscapeError
	var host url.InvalidHostError
	switch {
	case errors.As(err, &esc):
		why = "it has a '%' not followed by two hex digits: percent-encode a '%' in the user name or password as %25"
	case errors.As(err, &host), strings.Contains(err.Error(), "port"):
		why = "its host or port is malformed: percent-encode a '/', '#', '?', '@' or ':' in the user name or password " +
			"(%2F, %23, %3F, %40, %3A)"
	case strings.Contains(err.Error(), "scheme"):
		why = "its scheme is not one this client dials"
	}
	if s == "" {
		return fmt.Errorf("%s is malformed: %s", what, why)
	}
	return fmt.Errorf("%s %s is malformed: %s", what, URL(s), why)
}
