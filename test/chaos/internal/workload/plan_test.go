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
