package linearizable_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// full reports whether the runs are at full size: LINEARIZABLE_FULL=1,
// as make linearizable sets. Otherwise (go test ./..., make test) they
// are short: a few seconds each.
func full() bool { return os.Getenv("LINEARIZABLE_FULL") == "1" }

// size is a workload at short or full size.
func size(short, fullSize linearizable.Workload) linearizable.Workload {
	if full() {
		return fullSize
	}
	return short
}

// budget is the time porcupine may take per history.
func budget() time.Duration {
	if full() {
		return 2 * time.Minute
	}
	return 20 * time.Second
}

// outDir is where histories and visualizations of violations go:
// LINEARIZABLE_DIR, else a directory under the system's temporary one
// that outlives the test.
func outDir() string {
	if d := os.Getenv("LINEARIZABLE_DIR"); d != "" {
		return d
	}
	return filepath.Join(os.TempDir(), "amqpidem-linearizable")
}

// check checks run's history, prints the result line, and returns the
// result.
func check(t *testing.T, name string, p linearizable.Params, w linearizable.Workload, history []linearizable.Op) linearizable.Result {
	t.Helper()
	res, err := linearizable.Check(name, p, history, w.Clients, budget(), outDir())
	if err != nil {
		t.Fatalf("check %s: %v", name, err)
	}
	t.Log(res.String())
	t.Logf("%s: %s", name, linearizable.Summary(history))
	os.Stdout.WriteString(res.String() + "\n")
	if res.Other > 0 {
		t.Logf("%s: %d operations failed with errors no store documents (checked as ambiguous)", name, res.Other)
	}
	if res.Visualization != "" {
		t.Logf("%s: history %s, visualization %s (seed %d)", name, res.History, res.Visualization, w.Seed)
	}
	return res
}

// wantOK fails t unless res is ok.
func wantOK(t *testing.T, res linearizable.Result) {
	t.Helper()
	switch res.Check {
	case porcupine.Ok:
	case porcupine.Illegal:
		t.Errorf("%s: not linearizable: see %s", res.Name, res.Visualization)
	default:
		t.Errorf("%s: the check did not finish within its budget", res.Name)
	}
}

func seed() uint64 { return uint64(time.Now().UnixNano()) }

func TestMemory(t *testing.T) {
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	w := size(
		linearizable.Workload{Clients: 4, Keys: 8, Ops: 2000, Duration: 5 * time.Second, TTL: 20 * time.Millisecond, Timeout: time.Second, Seed: seed()},
		linearizable.Workload{Clients: 8, Keys: 16, Ops: 20000, Duration: 60 * time.Second, TTL: 20 * time.Millisecond, Timeout: time.Second, Seed: seed()},
	)
	run := linearizable.Start(s, w)
	wantOK(t, check(t, "memory-none", linearizable.Params{Early: lock.DeadlineSlack, Late: time.Millisecond}, w, run.History()))
}
