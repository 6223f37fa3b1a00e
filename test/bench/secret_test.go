package main

import (
	"strings"
	"testing"
)

// TestDialBrokerMalformedURLHidesPassword: an AMQP URL whose password has
// an unescaped '%', '#' or '/' is refused, redacted, without amqp091-go's
// parse error, which quotes it.
func TestDialBrokerMalformedURLHidesPassword(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss"} {
		url := "amqp://guest:" + pass + "@127.0.0.1:1/"
		_, err := dialBroker(url)
		t.Logf("%s: %v", pass, err)
		if err == nil {
			t.Fatalf("%s: dialBroker succeeded", pass)
		}
		if msg := err.Error(); strings.Contains(msg, pass) || strings.Contains(msg, `":p"`) ||
			!strings.Contains(msg, "amqp://guest:xxxxx@127.0.0.1:1/") {
			t.Errorf("%s: %s", pass, msg)
		}
	}
}
