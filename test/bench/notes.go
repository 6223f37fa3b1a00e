package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"
)

// openPG connects to PostgreSQL for the pg variants, unless they are off or
// have no classic queue to run on. When PostgreSQL does not answer, it
// says what to start and the bench goes on without them.
func (e *env) openPG(ctx context.Context, rep *report) error {
	switch {
	case !e.opts.PG:
		rep.PGSkipped = "-pg=false"
		return nil
	case !e.opts.measures(pgUnique) && !e.opts.measures(pgNaive) && !e.opts.measures(pgBatch):
		rep.PGSkipped = "-variants names none of them"
		return nil
	case !slices.Contains(e.opts.QueueTypes, "classic"):
		rep.PGSkipped = "they run on a classic queue, and -queues has none"
		return nil
	}
	p, err := openPG(ctx, e.opts, e.base)
	if err != nil {
		var unreachable *pgUnreachable
		if !errors.As(err, &unreachable) {
			return err
		}
		rep.PGSkipped = err.Error()
		e.pgHint = pgStartHint(e.opts.PGDSN)
		return nil
	}
	e.pg, rep.PGSchema, rep.PGCPU = p, p.schema, p.postmaster != 0
	return nil
}

// pgCPU is PostgreSQL's CPU time so far (postmaster and every server
// process), or 0 when it cannot be read here.
func (e *env) pgCPU() time.Duration {
	if e.pg == nil {
		return 0
	}
	return treeCPU(e.pg.postmaster)
}

// openedWhen says which pool the pg runs have.
func openedWhen(perRun bool) string {
	if perRun {
		return "a new pool each run, all its connections opened before measuring"
	}
	return "one pool for all pg runs, connections made as needed while measuring"
}

// pgNote is a PostgreSQL run's statements and commits per message, for
// its line.
func pgNote(r runResult) string {
	if r.PG == nil || r.N == 0 {
		return ""
	}
	return fmt.Sprintf("  %.2f stmt/msg, %.2f commit/msg", float64(r.PG.Statements)/float64(r.N), float64(r.PG.Committed())/float64(r.N))
}

// loadAvg is the 1, 5 and 15 minute load averages from /proc/loadavg, or
// "unknown".
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// stagedNote is, for an outbox or publish run, how many staged (or
// published) messages reached its outbox queue.
func stagedNote(r runResult) string {
	if r.Variant != outbox && r.Variant != publishV {
		return ""
	}
	return fmt.Sprintf("  %d staged", r.Staged)
}

func unexpectedNote(r runResult) string {
	if r.Unexpected == 0 {
		return ""
	}
	return fmt.Sprintf("  UNEXPECTED: %d (first: %s)", r.Unexpected, r.FirstUnexpected)
}

// thousands formats a rate as an integer with thousands separators.
func thousands(f float64) string {
	s := strconv.FormatInt(int64(f+0.5), 10)
	out := make([]byte, 0, len(s)+len(s)/3)
	for i := range len(s) {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	return string(out)
}

// heapAllocs returns the heap objects this process has allocated so far,
// and their bytes: exact counts, unlike CPU time, that the machine's load
// does not move (and the garbage collector's work follows the bytes).
func heapAllocs() (objects, bytes uint64) {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:objects"}, {Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 || s[1].Value.Kind() != metrics.KindUint64 {
		return 0, 0
	}
	return s[0].Value.Uint64(), s[1].Value.Uint64()
}

// allocsSampleRate is the mean bytes between two sampled allocations from
// the profiled run on: fine enough to see each allocation site of one
// message.
const allocsSampleRate = 4 << 10

// writeAllocs writes the allocations sampled so far to path. The profiled
// run writes them before (.allocs-base) and after (.allocs); the
// difference (go tool pprof -base) is its own, sampled finely.
func writeAllocs(path string) error {
	runtime.GC() // the profile is as of the last collection
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
