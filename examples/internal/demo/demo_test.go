package demo

import (
	"strings"
	"testing"
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
