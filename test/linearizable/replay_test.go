package linearizable_test

import (
	"os"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/test/linearizable"
)

// TestReplay explains a history Check wrote:
//
//	LINEARIZABLE_REPLAY=/tmp/amqpidem-linearizable/redis-kill9.json \
//	LINEARIZABLE_EARLY=3ms LINEARIZABLE_LATE=2ms go test -run TestReplay -v ./test/linearizable/
//
// EARLY and LATE are the Params of the run (see the test that wrote it);
// LINEARIZABLE_BUSY=1 sets Params.Busy (pgstore's runs), LINEARIZABLE_HELD=1
// Params.Held (pgstore's held runs, chaos-pg-kill9), LINEARIZABLE_SESSIONS_END=1
// Params.SessionsEnd (runs whose faults end sessions).
func TestReplay(t *testing.T) {
	path := os.Getenv("LINEARIZABLE_REPLAY")
	if path == "" {
		t.Skip("set LINEARIZABLE_REPLAY to a history file to explain it")
	}
	history, err := linearizable.ReadHistory(path)
	if err != nil {
		t.Fatal(err)
	}
	var p linearizable.Params
	for _, f := range []struct {
		env string
		d   *time.Duration
	}{{"LINEARIZABLE_EARLY", &p.Early}, {"LINEARIZABLE_LATE", &p.Late}} {
		if v := os.Getenv(f.env); v != "" {
			if *f.d, err = time.ParseDuration(v); err != nil {
				t.Fatalf("%s: %v", f.env, err)
			}
		}
	}
	p.Busy = os.Getenv("LINEARIZABLE_BUSY") != ""
	if os.Getenv("LINEARIZABLE_HELD") != "" {
		p.Held = heldOwner
	}
	p.SessionsEnd = os.Getenv("LINEARIZABLE_SESSIONS_END") != ""
	t.Logf("%d operations; violations:\n%s", len(history), linearizable.Explain(p, history, time.Minute))
}
