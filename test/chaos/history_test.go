//go:build linux

package chaos_test

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// recordHistory makes every consumer the scenario starts from now on
// record its store's history (-history <name>.<n>.history, next to its
// other files), for checkHistory at the end.
func (e *env) recordHistory() {
	e.mu.Lock()
	e.history = true
	e.mu.Unlock()
}

// historyFlags are the flags that make a consumer started as base record
// its history, if the scenario asked for it.
func (e *env) historyFlags(base string) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.history {
		return nil
	}
	return []string{"-history", base + ".history"}
}

// redisClock is the Params of Redis on this host: leases run by the
// server's clock in milliseconds (DeadlineSlack), a millisecond or two
// either way between it and the consumers' wall clocks.
var redisClock = linearizable.Params{Early: lock.DeadlineSlack + 2*time.Millisecond, Late: 2 * time.Millisecond}

// pgClock is the Params of pgstore on this host, used through its
// TxHandler: leases by the server's clock as Redis's are (redisClock); an
// Acquire may answer a busy InProgress (Params.Busy); leases held by
// transactions (owner tokens beginning with 't', pgstore's mark) write no
// record until their outcome, and end with their session, which a
// killed consumer's connections end at once (Params.SessionsEnd).
var pgClock = linearizable.Params{Early: redisClock.Early, Late: redisClock.Late, Busy: true,
	Held: func(owner string) bool { return strings.HasPrefix(owner, "t") }, SessionsEnd: true}

// checkHistory merges the histories the scenario's consumer processes
// recorded (recordHistory), each process a client, and checks them with
// porcupine against the model of one key's record (test/linearizable)
// with clock p: a call of a process killed in the middle of it has no
// return, and is taken as ambiguous (applied at any time from its call
// on, or never), as Knossos does. It prints the line "linearizable
// chaos-<name> ops=N keys=K clients=C result=ok|violation checked_ms=X",
// and on a violation fails the test, having written the history and
// porcupine's visualization of the failing key to LINEARIZABLE_DIR
// (default $TMPDIR/amqpidem-linearizable). Call it once every consumer
// has stopped.
func (e *env) checkHistory(name string, p linearizable.Params) linearizable.Result {
	e.t.Helper()
	paths, err := filepath.Glob(filepath.Join(e.dir, "*.history"))
	if err != nil {
		e.t.Fatal(err)
	}
	sort.Strings(paths)
	if len(paths) == 0 {
		e.t.Fatalf("chaos-%s: no history recorded (recordHistory before the consumers start)", name)
	}
	history, err := linearizable.ReadHistories(paths...)
	if err != nil {
		e.t.Fatal(err)
	}
	dir := os.Getenv("LINEARIZABLE_DIR")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "amqpidem-linearizable")
	}
	res, err := linearizable.Check("chaos-"+name, p, history, len(paths), pick(time.Minute, 5*time.Minute), dir)
	if err != nil {
		e.t.Fatalf("check chaos-%s: %v", name, err)
	}
	printFigures(e.t, res.String())
	e.t.Logf("chaos-%s: %s; %d calls without an answer (%d of them cut off by a kill)", name, linearizable.Summary(history), res.Ambiguous, noReturn(history))
	switch res.Check {
	case porcupine.Ok:
	case porcupine.Illegal:
		e.t.Errorf("chaos-%s: the store's history is not linearizable: history %s, visualization %s", name, res.History, res.Visualization)
	default:
		e.t.Errorf("chaos-%s: the check did not finish within its budget", name)
	}
	return res
}

// noReturn counts the calls of history whose process ended during them.
func noReturn(history []linearizable.Op) int {
	n := 0
	for _, op := range history {
		if op.Out.Err == linearizable.ErrAmbiguous && op.Out.Return == 0 {
			n++
		}
	}
	return n
}
