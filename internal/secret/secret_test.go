package secret

import (
	"errors"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestURL(t *testing.T) {
	for in, want := range map[string]string{
		"amqp://guest:guest@127.0.0.1:5672/":       "amqp://guest:xxxxx@127.0.0.1:5672/",
		"amqp://guest:p%zz@127.0.0.1:5672/":        "amqp://guest:xxxxx@127.0.0.1:5672/",
		"amqp://guest:p#ss@127.0.0.1:5672/":        "amqp://guest:xxxxx@127.0.0.1:5672/",
		"amqp://guest:p/s@s@127.0.0.1:5672/vh":     "amqp://guest:xxxxx@127.0.0.1:5672/vh",
		"amqp://guest:123/ss@127.0.0.1:5672/":      "amqp://guest:xxxxx@127.0.0.1:5672/",
		"redis://:secret@127.0.0.1:6379/0":         "redis://:xxxxx@127.0.0.1:6379/0",
		"redis://127.0.0.1:6379/0":                 "redis://127.0.0.1:6379/0",
		"amqp://guest@h/":                          "amqp://guest@h/",
		"amqp://s%zz@h/":                           "amqp://xxxxx@h/",
		"host=h password=secret user=u":            "host=h password=xxxxx user=u",
		"host=h password = 'se cr\\'et' user=u":    "host=h password = xxxxx user=u",
		"host=h PASSWORD=se\\ cret dbname=d":       "host=h PASSWORD=xxxxx dbname=d",
		"postgres://u:secret@h/d?sslmode=disable":  "postgres://u:xxxxx@h/d?sslmode=disable",
		"postgres://u@h/d?a=1&password=secret&b=2": "postgres://u@h/d?a=1&password=xxxxx&b=2",
		"postgres://h/d?PassWord=se%zzcret":        "postgres://h/d?PassWord=xxxxx",
	} {
		if got := URL(in); got != want {
			t.Errorf("URL(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestParseError: the error of a URL that does not parse names it
// redacted and quotes nothing of the password, which the parsers'
// errors do.
func TestParseError(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss", "p?ss"} {
		s := "amqp://guest:" + pass + "@127.0.0.1:5672/"
		_, perr := amqp.ParseURI(s)
		if perr == nil {
			t.Fatalf("ParseURI(%q) parsed", s)
		}
		err := ParseError("ConsumerConfig.URL", s, perr)
		msg := err.Error()
		if strings.Contains(msg, pass) || strings.Contains(msg, pass[:2]+"\"") || strings.Contains(msg, `":p"`) {
			t.Errorf("%q: the error quotes the password: %s", s, msg)
		}
		if !strings.Contains(msg, "amqp://guest:xxxxx@127.0.0.1:5672/") {
			t.Errorf("%q: the error does not name the redacted URL: %s", s, msg)
		}
		if strings.Contains(msg, "parse \"") || errors.Unwrap(err) != nil {
			t.Errorf("%q: the error wraps the parser's: %s", s, msg)
		}
	}
}
