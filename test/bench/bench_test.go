package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// TestShortRun runs the harness in its smoke mode against the real services,
// so that `make test` notices when the measurement stops working. It checks
// that every variant settled every message as expected (the PostgreSQL
// variants: and left the effect rows they should; outbox: and put one
// staged message per message in its queue), that the run removed
// what it made, and that the output ends with the ratio lines; it never
// looks at how fast anything was. Without PostgreSQL it fails, as a test
// without Redis or RabbitMQ does, except under -short without CI=true,
// where the PostgreSQL variants are left out.
func TestShortRun(t *testing.T) {
	var out bytes.Buffer
	// Two pairs at each fixed rate: the latency_p99_ms lines take their
	// median.
	opts, err := parseFlags([]string{"-short", "-latency-repeats", "2"}, &out)
	if err != nil {
		t.Fatal(err)
	}
	opts.AMQPURL, opts.RedisAddr = testenv.AMQPURL(t), testenv.RedisAddr(t)
	// The profiled run, of outbox, with its step times.
	opts.CPUProfile, opts.ProfileVariant = filepath.Join(t.TempDir(), "outbox.pprof"), string(outbox)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := run(ctx, opts, &out)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	for _, path := range []string{opts.CPUProfile, opts.CPUProfile + ".allocs-base", opts.CPUProfile + ".allocs"} {
		if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
			t.Errorf("profile %s: %v, want a file with the profiled run in it", path, err)
		}
	}

	if rep.WaitSkipped != "" {
		if os.Getenv("CI") == "true" {
			t.Errorf("unique-wait skipped: %s", rep.WaitSkipped)
		} else {
			t.Logf("unique-wait skipped: %s", rep.WaitSkipped)
		}
	}
	if rep.DynamoSkipped != "" {
		if testing.Short() && os.Getenv("CI") != "true" {
			t.Logf("DynamoDB variants skipped: %s", rep.DynamoSkipped)
		} else {
			t.Errorf("DynamoDB variants skipped: %s", rep.DynamoSkipped)
		}
	}
	if rep.PGSkipped != "" {
		if testing.Short() && os.Getenv("CI") != "true" {
			t.Logf("PostgreSQL variants skipped: %s", rep.PGSkipped)
		} else {
			t.Errorf("PostgreSQL variants skipped: %s", rep.PGSkipped)
		}
	} else {
		if !slices.Contains(rep.Variants["classic"], pgUnique) || !slices.Contains(rep.Variants["classic"], pgDuplicate) ||
			!slices.Contains(rep.Variants["classic"], pgNaive) {
			t.Errorf("classic variants %v lack a PostgreSQL variant", rep.Variants["classic"])
		}
		if !rep.PGDropped {
			t.Errorf("PostgreSQL schema %s not dropped", rep.PGSchema)
		}
	}

	for _, qt := range opts.QueueTypes {
		for _, v := range rep.Variants[qt] {
			runs := 0
			for _, r := range rep.Runs {
				if r.Round == 0 || r.QueueType != qt || r.Variant != v {
					continue
				}
				runs++
				if got, want := r.Settled, r.N; got != want {
					t.Errorf("%s %s round %d: settled %d messages, want %d", qt, v, r.Round, got, want)
				}
				if got := r.Unexpected; got != 0 {
					t.Errorf("%s %s round %d: %d unexpected outcomes (first: %s)", qt, v, r.Round, got, r.FirstUnexpected)
				}
				if got, want := r.EffectRows, r.Effects; got != want {
					t.Errorf("%s %s round %d: %d effect rows, want %d", qt, v, r.Round, got, want)
				}
				if got, want := r.Staged, r.N; (v == outbox || v == publishV) && got != want {
					t.Errorf("%s %s round %d: %d staged messages reached the outbox queue, want %d", qt, v, r.Round, got, want)
				}
				// A duplicate's transaction (a lease held by it, found
				// completed) ends in a rollback; every other message commits.
				// A batch commits once per batch: at least once, and far
				// less than once per message (issue 39).
				if v == pgBatch && (r.PG == nil || r.PG.Committed() < 1 || r.PG.Committed() > int64(r.N)/10) {
					t.Errorf("%s %s round %d: PostgreSQL counts %+v, want a commit per batch, not per message", qt, v, r.Round, r.PG)
				}
				if v.isPG() && v != pgBatch && (r.PG == nil || r.PG.Statements < int64(r.N) || r.PG.Committed()+r.PG.Rollbacks < int64(r.N) ||
					v != pgDuplicate && r.PG.Committed() < int64(r.N)) {
					t.Errorf("%s %s round %d: PostgreSQL counts %+v, want at least a statement and a commit (a duplicate: a commit or a rollback) per message", qt, v, r.Round, r.PG)
				}
			}
			if got, want := runs, opts.Repeats; got != want {
				t.Errorf("%s %s: %d runs, want %d", qt, v, got, want)
			}
		}
	}
	// bare and unique per queue type, at the saturating rate and each of
	// LatencyRates; pg-batch and a bare consumer beside it on classic at
	// each of LatencyRates.
	wantLatency := 2 * len(opts.QueueTypes) * (1 + opts.LatencyRepeats*len(opts.LatencyRates))
	if rep.PGSkipped == "" {
		wantLatency += 2 * opts.LatencyRepeats * len(opts.LatencyRates)
	}
	if got, want := len(rep.Latency), wantLatency; got != want {
		t.Errorf("latency runs: got %d, want %d", got, want)
	}
	groups := map[int][]variant{}
	for _, l := range rep.Latency {
		groups[l.Group] = append(groups[l.Group], l.Variant)
		if got, want := l.Settled, l.N+1; got != want { // +1: the probe
			t.Errorf("latency %s %s: settled %d, want %d", l.QueueType, l.Variant, got, want)
		}
		if l.Samples == 0 {
			t.Errorf("latency %s %s: no samples", l.QueueType, l.Variant)
		}
	}
	// Each group is bare and the variant compared with it.
	for g, vs := range groups {
		if len(vs) != 2 || vs[0] != bare || vs[1] != unique && vs[1] != pgBatch {
			t.Errorf("latency group %d: %v, want bare and unique or pg-batch", g, vs)
		}
	}
	if m := rep.Memory; m == nil {
		t.Error("no memory phase")
	} else {
		if got, want := m.Settled, m.Handlers; got != want {
			t.Errorf("memory phase: settled %d, want %d", got, want)
		}
		if m.Unexpected != 0 || m.InFlight == 0 {
			t.Errorf("memory phase: %d unexpected outcomes, %d in flight when sampled", m.Unexpected, m.InFlight)
		}
	}
	if st := rep.Steps; st == nil {
		t.Error("the profiled outbox run has no step times")
	} else if got, want := st.Outboxed, int64(rep.n(opts.QueueTypes[0], outbox)); st.N != want || got != want {
		t.Errorf("profiled outbox run: step times of %d completed deliveries, %d with staged messages, want %d of both", st.N, got, want)
	}
	if rep.LeftKeys != 0 {
		t.Errorf("%d Redis keys %s* left behind", rep.LeftKeys, rep.Base)
	}

	// The output ends with one ratio line per variant and queue type, in
	// order, two decimals: unique, duplicate, naive, then on classic
	// pg-unique, pg-duplicate, pg-naive; then outbox over unique on each.
	lines := strings.Split(strings.TrimRight(out.String(), "\n"), "\n")
	var want []string
	for _, qt := range opts.QueueTypes {
		for _, v := range ratioVariants {
			if v.isPG() && (qt != "classic" || rep.PGSkipped != "") || v == uniqueWait && rep.WaitSkipped != "" {
				continue
			}
			want = append(want, `^ratio `+regexp.QuoteMeta(string(v))+`/bare `+qt+` \d+\.\d\d$`)
		}
	}
	for _, qt := range opts.QueueTypes {
		want = append(want, `^ratio outbox/unique `+qt+` \d+\.\d\d$`)
	}
	// Issue 40's: outbox over publish on each.
	for _, qt := range opts.QueueTypes {
		want = append(want, `^ratio outbox/publish `+qt+` \d+\.\d\d$`)
	}
	// Then issue 14's lines: Redis CPU per unique, duplicate and outbox
	// message, issue 40's machine CPU per message of every variant and
	// unique's over bare's (the RabbitMQ node runs here: its CPU is
	// measured), the added p99 at each fixed rate.
	ratioLines := len(want)
	if rep.BrokerPID == 0 {
		t.Error("the RabbitMQ node's CPU was not measured: no beam.smp of RabbitMQ found in /proc")
	}
	for _, qt := range opts.QueueTypes {
		want = append(want, `^redis_us unique `+qt+` \d+\.\d$`, `^redis_us duplicate `+qt+` \d+\.\d$`,
			`^redis_us outbox `+qt+` \d+\.\d$`)
		for _, v := range rep.Variants[qt] {
			want = append(want, `^machine_us `+regexp.QuoteMeta(string(v))+` `+qt+` \d+\.\d$`)
		}
		want = append(want, `^machine_x unique `+qt+` \d+\.\d\d$`)
		for _, r := range opts.LatencyRates {
			want = append(want, `^latency_p99_ms `+strconv.FormatFloat(r, 'f', -1, 64)+` `+qt+` -?\d+\.\d( saturated)?$`)
		}
	}
	// Then issue 26's allocations per message.
	want = append(want, `^allocs unique \d+$`, `^allocs duplicate \d+$`)
	// Then issue 25's, on classic, when the DynamoDB variants ran.
	if rep.DynamoSkipped == "" && slices.Contains(opts.QueueTypes, "classic") {
		want = append(want, `^ratio dynamo-unique/bare classic \d+\.\d\d$`, `^ratio dynamo-duplicate/bare classic \d+\.\d\d$`)
	}
	// Then issue 24's relay lines, with PostgreSQL.
	if rep.RelaySkipped == "" {
		if len(rep.Relay) != opts.Repeats || rep.RelayLatency == nil || rep.RelayLatency.Samples == 0 {
			t.Errorf("relay phase: %d rate runs, latency %+v; want %d runs and samples", len(rep.Relay), rep.RelayLatency, opts.Repeats)
		}
		want = append(want, `^relay_msgs_per_s classic \d+$`, `^relay_p99_ms classic \d+\.\d( saturated)?$`)
		// Issue 34's: an ordered relay drains one key's backlog; a
		// "timeout" there fails the line's pattern, and out-of-order
		// deliveries fail here.
		if d := rep.RelayOrdered; d == nil {
			t.Error("relay phase: no ordered drain run")
		} else {
			if d.TimedOut {
				t.Errorf("relay phase: an ordered relay did not drain %d rows of one key within %v: %d sent, %d received",
					d.N, d.Timeout, d.SentRows, d.Received)
			}
			if d.OutOfOrder != 0 {
				t.Errorf("relay phase: the ordered drain delivered %d messages after later ones of their key", d.OutOfOrder)
			}
		}
		want = append(want, `^relay_ordered_drain_ms `+strconv.Itoa(opts.RelayOrderedN)+` \d+$`)
	} else if rep.PGSkipped == "" {
		t.Errorf("relay phase skipped: %s", rep.RelaySkipped)
	}
	// Then issue 26's PostgreSQL lines.
	if rep.PGSkipped == "" {
		want = append(want, `^ratio pg-unique/pg-naive classic \d+\.\d\d$`)
		if !rep.PGCPU {
			t.Error("PostgreSQL's CPU was not measured: its postmaster is not readable here")
		}
		want = append(want, `^pg_cpu_us pg-unique classic \d+\.\d$`, `^pg_cpu_us pg-naive classic \d+\.\d$`)
		// Issue 39's.
		want = append(want, `^ratio pg-batch/pg-naive classic \d+\.\d\d$`, `^commits_per_msg pg-batch \d+\.\d\d\d$`)
		for _, r := range opts.LatencyRates {
			want = append(want, `^latency_p99_ms pg-batch `+strconv.FormatFloat(r, 'f', -1, 64)+` classic -?\d+\.\d( saturated)?$`)
		}
	}
	// Then issue 39's batch sizes: the batch variant on each queue type,
	// pg-batch on classic.
	for _, qt := range []string{"classic", "quorum"} {
		if !slices.Contains(opts.QueueTypes, qt) {
			continue
		}
		want = append(want, `^batch_size batch `+qt+` \d+\.\d$`)
		if qt == "classic" && rep.PGSkipped == "" {
			want = append(want, `^batch_size pg-batch classic \d+\.\d$`)
		}
	}
	if len(lines) < len(want) {
		t.Fatalf("output has %d lines, want at least %d", len(lines), len(want))
	}
	tail := lines[len(lines)-len(want):]
	for i, pattern := range want {
		if !regexp.MustCompile(pattern).MatchString(tail[i]) {
			kind := "ratio line"
			if i >= ratioLines {
				kind = "target line"
			}
			t.Errorf("%s %d: got %q, want a match of %s", kind, i+1, tail[i], pattern)
		}
	}
}

// TestPGStartHint checks that a bench without PostgreSQL says what to
// start: the local default, or the one the DSN names.
func TestPGStartHint(t *testing.T) {
	for _, want := range []string{"bash scripts/services.sh postgres", "pg_ctlcluster 15 main start", "docker compose up -d --wait postgres"} {
		if got := pgStartHint(defaultPGDSN); !strings.Contains(got, want) {
			t.Errorf("hint for the default DSN lacks %q:\n%s", want, got)
		}
	}
	if got := pgStartHint("postgres://u@127.0.0.1:5433/db"); !strings.Contains(got, "PG_DSN") {
		t.Errorf("hint for another DSN does not name PG_DSN:\n%s", got)
	}
}

// addedP99 pairs each bare run with the run of its own group, and gives
// the median of what those pairs added, not a difference across groups.
func TestAddedP99(t *testing.T) {
	ms := func(n float64) time.Duration { return time.Duration(n * float64(time.Millisecond)) }
	run := func(v variant, group int, p99 float64) latencyResult {
		return latencyResult{QueueType: "classic", Variant: v, Rate: 1000, Group: group,
			Samples: 10, P99: ms(p99), Length: time.Second}
	}
	runs := []latencyResult{
		run(bare, 1, 1), run(unique, 1, 2), // +1
		run(bare, 2, 150), run(unique, 2, 151.5), // a stall on both: +1.5
		run(bare, 3, 2), run(unique, 3, 2.5), // +0.5
		run(bare, 4, 1), run(pgBatch, 4, 20), // another variant's pair
	}
	got, note, ok := addedP99(runs, unique, "classic", 1000)
	if !ok || note != "" || got != 1 {
		t.Errorf("addedP99 unique = %v, %q, %v; want 1 (the median of +1, +1.5, +0.5)", got, note, ok)
	}
	if got, _, ok := addedP99(runs, pgBatch, "classic", 1000); !ok || got != 19 {
		t.Errorf("addedP99 pg-batch = %v, %v; want 19", got, ok)
	}
	if _, _, ok := addedP99(runs, unique, "quorum", 1000); ok {
		t.Error("addedP99 found a pair on a queue type with no runs")
	}
	runs[5].Lag = time.Second // unique of group 3 fell behind
	if _, note, _ := addedP99(runs, unique, "classic", 1000); note != " saturated" {
		t.Errorf("note %q, want saturated", note)
	}
}

// machine_us is the median of the rounds' machine CPU per message: one
// round slowed by a stall moves it no more than the round beside it.
func TestMachinePerMessageMedian(t *testing.T) {
	run := func(v variant, round int, n int, cpu time.Duration) runResult {
		return runResult{QueueType: "quorum", Variant: v, Round: round, N: n, ProcCPU: cpu}
	}
	runs := []runResult{
		run(bare, 0, 100, 9*time.Millisecond), // calibration: not a round
		run(bare, 1, 1000, 40*time.Millisecond),
		run(bare, 2, 1000, 41*time.Millisecond),
		run(bare, 3, 1000, 70*time.Millisecond), // a stalled round
		run(unique, 1, 1000, 50*time.Millisecond),
		run(unique, 2, 1000, 0), // not measured (the node restarted)
		run(unique, 3, 1000, 52*time.Millisecond),
	}
	if got := machinePerMessage(runs, "quorum", bare); got != 41e3 {
		t.Errorf("bare: %v ns a message, want the median round's 41000 (the mean would be 50333)", got)
	}
	if got := machinePerMessage(runs, "quorum", unique); got != 51e3 {
		t.Errorf("unique: %v ns a message, want 51000 (the two measured rounds)", got)
	}
	if got := machinePerMessage(runs, "classic", bare); got != 0 {
		t.Errorf("no runs: %v, want 0", got)
	}
}

// Every round runs each unit once, the first round in the tables' order,
// and a unit does not follow the same one in each of the first rounds.
func TestRoundOrder(t *testing.T) {
	for _, n := range []int{1, 2, 3, 7, 8, 11} {
		pred := map[[2]int]int{} // {unit, its predecessor}: rounds
		for round := 1; round <= 3; round++ {
			order := roundOrder(n, round)
			seen := make([]bool, n)
			for _, k := range order {
				if k < 0 || k >= n || seen[k] {
					t.Fatalf("n %d round %d: %v is not an order of the units", n, round, order)
				}
				seen[k] = true
			}
			if len(order) != n {
				t.Fatalf("n %d round %d: %v", n, round, order)
			}
			if round == 1 && !slices.IsSorted(order) {
				t.Errorf("n %d: round 1 runs %v, want the tables' order", n, order)
			}
			if order[0] != (round-1)%n {
				t.Errorf("n %d round %d: led by %d, want %d", n, round, order[0], (round-1)%n)
			}
			for k := 1; k < n; k++ {
				pred[[2]int{order[k], order[k-1]}]++
			}
		}
		for p, rounds := range pred {
			if n >= 7 && rounds > 1 {
				t.Errorf("n %d: unit %d follows unit %d in %d of 3 rounds", n, p[0], p[1], rounds)
			}
		}
	}
}
