package workload_test

import (
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

func TestParsePlan(t *testing.T) {
	p := workload.Plan{Op: "op-1", WorkMS: 20, Crash: workload.AfterEffect, FailUntil: 3}
	tests := []struct {
		name string
		body []byte
		want workload.Plan
	}{
		{"round trip", p.Body(), p},
		{"empty", nil, workload.Plan{}},
		{"binary", []byte{0, 1, 2, 0xff}, workload.Plan{}},
		{"not a plan", []byte(`{"work_ms":"slow"}`), workload.Plan{}},
		{"huge", append([]byte(`{"work_ms":1,"op":"`), make([]byte, 1<<17)...), workload.Plan{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := workload.ParsePlan(tc.body); got != tc.want {
				t.Fatalf("ParsePlan: got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestParsePlanStaged(t *testing.T) {
	p := workload.Plan{Op: "op-1", StageID: "op-1.b", Next: &workload.Plan{WorkMS: 5},
		Origin: &workload.Origin{Exec: "c1.7.3", Fence: 42, Attempt: 2}}
	got := workload.ParsePlan(p.Body())
	if got.Next == nil || *got.Next != *p.Next {
		t.Fatalf("ParsePlan: Next got %+v, want %+v", got.Next, *p.Next)
	}
	if got.Origin == nil || *got.Origin != *p.Origin {
		t.Fatalf("ParsePlan: Origin got %+v, want %+v", got.Origin, *p.Origin)
	}
	if got.Op != p.Op || got.StageID != p.StageID {
		t.Fatalf("ParsePlan: got op %q stage id %q, want %q %q", got.Op, got.StageID, p.Op, p.StageID)
	}
}

func TestPlanWork(t *testing.T) {
	p := workload.Plan{WorkMS: 500, LongUntil: 3}
	for attempt, want := range map[int]time.Duration{1: 500 * time.Millisecond, 2: 500 * time.Millisecond, 3: 0, 4: 0} {
		if got := p.Work(attempt); got != want {
			t.Errorf("Work(%d): got %v, want %v", attempt, got, want)
		}
	}
	if got, want := (workload.Plan{WorkMS: 7}).Work(9), 7*time.Millisecond; got != want {
		t.Errorf("Work without LongUntil: got %v, want %v", got, want)
	}
}
