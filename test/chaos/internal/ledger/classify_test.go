package ledger_test

import (
	"strings"
	"testing"

	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
)

func TestOpStatsClassification(t *testing.T) {
	tests := []struct {
		name                         string
		s                            ledger.OpStats
		lost, duplicated, reexecuted bool
	}{
		{"applied once", ledger.OpStats{Expect: ledger.ExpectApply, Executions: 1, Applied: 1}, false, false, false},
		{"never applied", ledger.OpStats{Expect: ledger.ExpectApply, Executions: 2}, true, false, false},
		{"re-executed, absorbed", ledger.OpStats{Expect: ledger.ExpectApply, Executions: 2, Applied: 1, Absorbed: 1}, false, false, true},
		{"re-executed, stale rejected", ledger.OpStats{Expect: ledger.ExpectApply, Executions: 2, Applied: 1, Stale: 1}, false, false, true},
		{"applied twice", ledger.OpStats{Expect: ledger.ExpectApply, Executions: 2, Applied: 2}, false, true, false},
		{"applied and dead-lettered", ledger.OpStats{Expect: ledger.ExpectApply, Executions: 1, Applied: 1, DeadLetters: 1}, false, true, false},
		{"dead-lettered once", ledger.OpStats{Expect: ledger.ExpectDeadLetter, Executions: 4, DeadLetters: 1}, false, false, true},
		{"dead-lettered twice", ledger.OpStats{Expect: ledger.ExpectDeadLetter, Executions: 1, DeadLetters: 2}, false, true, false},
		{"never dead-lettered", ledger.OpStats{Expect: ledger.ExpectDeadLetter, Executions: 1}, true, false, false},
		{"dead letter applied", ledger.OpStats{Expect: ledger.ExpectDeadLetter, Executions: 1, Applied: 1, DeadLetters: 1}, false, true, false},
		{"both", ledger.OpStats{Expect: ledger.ExpectBoth, Executions: 1, Applied: 1, DeadLetters: 1}, false, false, false},
		{"both, not dead-lettered", ledger.OpStats{Expect: ledger.ExpectBoth, Executions: 1, Applied: 1}, true, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got, want := tc.s.Lost(), tc.lost; got != want {
				t.Fatalf("Lost: got %v, want %v", got, want)
			}
			if got, want := tc.s.Duplicated(), tc.duplicated; got != want {
				t.Fatalf("Duplicated: got %v, want %v", got, want)
			}
			if got, want := tc.s.Reexecuted(), tc.reexecuted; got != want {
				t.Fatalf("Reexecuted: got %v, want %v", got, want)
			}
		})
	}
}

func TestOpID(t *testing.T) {
	tests := []struct {
		key    string
		hashed bool
	}{
		{"op-1", false},
		{"{braces}:x", false},
		{strings.Repeat("k", 200), false},
		{strings.Repeat("k", 201), true},
		{"nul\x00byte", true},
		{"\xff\xfe invalid utf-8", true},
	}
	for _, tc := range tests {
		got := ledger.OpID(tc.key)
		if hashed := strings.HasPrefix(got, "sha256:"); hashed != tc.hashed || (!hashed && got != tc.key) {
			t.Errorf("OpID(%q) = %q; want hashed %v", tc.key, got, tc.hashed)
		}
		if got != ledger.OpID(tc.key) {
			t.Errorf("OpID(%q) is not stable", tc.key)
		}
	}
}

func TestReportLine(t *testing.T) {
	r := ledger.Report{Name: "storm", Ops: 10, Lost: 0, Duplicated: 0, Reexecuted: 2, StaleRejected: 1}
	if got, want := r.Line(), "scenario storm ops=10 lost=0 duplicated=0 reexecuted=2 stale_rejected=1"; got != want {
		t.Fatalf("Line: got %q, want %q", got, want)
	}
}
