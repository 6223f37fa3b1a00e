package pgstore

import (
	"strings"
	"testing"
)

// TestRelayMalformedURLHidesPassword: a RelayConfig.URL that cannot
// parse is refused by Validate (NewRelay), not dialled on every round,
// and the error names it redacted, quoting nothing of the password.
func TestRelayMalformedURLHidesPassword(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss"} {
		err := RelayConfig{URL: "amqp://guest:" + pass + "@127.0.0.1:5672/"}.Validate()
		t.Logf("%s: %v", pass, err)
		if err == nil {
			t.Errorf("%s: Validate accepts a URL that does not parse", pass)
			continue
		}
		if msg := err.Error(); strings.Contains(msg, pass) || strings.Contains(msg, `":p"`) ||
			!strings.Contains(msg, "amqp://guest:xxxxx@127.0.0.1:5672/") {
			t.Errorf("%s: %v", pass, err)
		}
	}
}
