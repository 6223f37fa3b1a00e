package main_test

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// step is one command of a transcript and what it printed.
type step struct {
	args []string
	want string
}

// transcript reads the commands and outputs between the markers of
// docs/operating.md (until issue 41, the README's "Operating it" section,
// hence the test's name).
func transcript(t *testing.T) []step {
	t.Helper()
	steps, ok := transcriptIn(t, "docs/operating.md")
	if !ok {
		t.Fatalf("docs/operating.md has no transcript between %q and %q", transcriptBegin, transcriptEnd)
	}
	return steps
}

// The markers around a transcript.
const transcriptBegin, transcriptEnd = "<!-- transcript: cmd/amqpidem/readme_test.go -->\n```console\n", "```\n<!-- end of transcript -->"

// transcriptIn reads the commands and outputs between the markers in the
// file path of the repository; false when it has none.
func transcriptIn(t *testing.T, path string) ([]step, bool) {
	t.Helper()
	b, err := os.ReadFile("../../" + path)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	i, j := strings.Index(text, transcriptBegin), strings.Index(text, transcriptEnd)
	if i < 0 || j < i {
		return nil, false
	}
	var steps []step
	for _, line := range strings.SplitAfter(text[i+len(transcriptBegin):j], "\n") {
		if cmd, ok := strings.CutPrefix(line, "$ amqpidem "); ok {
			steps = append(steps, step{args: strings.Fields(cmd)})
		} else if len(steps) > 0 {
			steps[len(steps)-1].want += line
		}
	}
	return steps, true
}

var normalizers = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z`), "<time>"},
	{regexp.MustCompile(`\{[0-9a-f]{32}\}`), "{<hash>}"},
	{regexp.MustCompile(`\b[0-9a-f]{32}\b`), "<owner>"},
	{regexp.MustCompile(`\b\d{13,}\b`), "<fence>"},
	{regexp.MustCompile(`\b(\d+h)?(\d+m)?\d+(\.\d+)?(ms|s)\b`), "<duration>"},
	{regexp.MustCompile(`(?m)[ \t]+$`), ""},
	{regexp.MustCompile(`[ \t]+`), " "},
}

// normalize hides what differs from run to run (times, fences, owners,
// hashes) and the alignment of columns.
func normalize(s string) string {
	for _, n := range normalizers {
		s = n.re.ReplaceAllString(s, n.with)
	}
	return strings.TrimSpace(s)
}

// The transcript of docs/operating.md is what the commands print: run it against a
// consumer whose handler declines payments until the cause is fixed (just
// before the first replay with --forget).
func TestReadmeTranscript(t *testing.T) {
	steps := transcript(t)
	if len(steps) < 4 {
		t.Fatalf("the transcript has %d commands", len(steps))
	}
	r := newRig(t, 4)
	r.publish("pay-1042")
	r.waitOutcomes(amqpidem.DeadLettered, 1)
	var got strings.Builder
	failed := false
	for _, s := range steps {
		args := make([]string, len(s.args))
		for i, a := range s.args {
			args[i] = strings.ReplaceAll(a, "payments", r.queue)
		}
		if strings.Contains(strings.Join(args, " "), "--forget") && r.broken.Load() {
			r.broken.Store(false) // the cause is fixed
		}
		stdout, stderr, _ := r.cli(args...)
		out := strings.ReplaceAll(stdout+stderr, r.prefix, "amqpidem")
		out = strings.ReplaceAll(out, r.queue, "payments")
		got.WriteString("$ amqpidem " + strings.Join(s.args, " ") + "\n" + out)
		if normalize(out) != normalize(s.want) {
			failed = true
			t.Errorf("amqpidem %s printed\n%s\nthe README says\n%s", strings.Join(s.args, " "), out, s.want)
		}
		if strings.Contains(out, "1 replayed") {
			r.waitOutcomes(amqpidem.Completed, 1)
		}
	}
	if failed {
		t.Logf("the whole transcript as it ran now:\n%s", got.String())
	}
}

// The transcript of docs/outbox.md is what the commands print: run it
// against a consumer of the queue orders whose handler stages three
// messages: one to orders.audit, two to orders.shipping, which does not
// exist (so the broker returns them) until just before the first redrive
// that is not a --dry-run.
func TestOutboxTranscript(t *testing.T) {
	steps, ok := transcriptIn(t, "docs/outbox.md")
	if !ok {
		t.Skipf("docs/outbox.md has no transcript between %q and %q yet", transcriptBegin, transcriptEnd)
	}
	prefix := "cli-" + testenv.Name(t)
	rdb := testenv.RedisClient(t)
	testenv.DeleteKeys(t, rdb, prefix+":*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	r := newStagingRig(t, store, []string{"--redis", "redis://" + testenv.RedisAddr(t) + "/0", "--prefix", prefix})
	r.pay("order-1042", 2)
	var got strings.Builder
	failed, fixed := false, false
	for _, s := range steps {
		args := make([]string, len(s.args))
		for i, a := range s.args {
			args[i] = strings.ReplaceAll(a, "orders", r.queue)
		}
		if len(args) > 1 && args[0] == "outbox" && args[1] == "redrive" && !slices.Contains(args, "--dry-run") && !fixed {
			if _, err := r.ch.QueueDeclare(r.shipping, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			fixed = true
		}
		stdout, stderr, _ := r.run(args...)
		out := strings.ReplaceAll(stdout+stderr, prefix, "amqpidem")
		out = strings.ReplaceAll(out, r.queue, "orders")
		got.WriteString("$ amqpidem " + strings.Join(s.args, " ") + "\n" + out)
		if normalize(out) != normalize(s.want) {
			failed = true
			t.Errorf("amqpidem %s printed\n%s\nthe docs say\n%s", strings.Join(s.args, " "), out, s.want)
		}
	}
	if failed {
		t.Logf("the whole transcript as it ran now:\n%s", got.String())
	}
}
