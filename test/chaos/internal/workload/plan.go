// Package workload describes what the chaos suite's handler does with each
// message (a Plan, carried as the message body) and publishes workloads:
// operations, each in one or more copies, with publisher confirms.
package workload

import (
	"encoding/json"
	"time"
)

// Crash windows: where a consumer process kills itself (SIGKILL, once per
// operation and window).
const (
	// BeforeEffect: the handler started, the side effect is not written.
	BeforeEffect = "before-effect"
	// AfterEffect: the handler wrote the side effect and returned; the
	// record is not completed yet.
	AfterEffect = "after-effect"
	// AfterComplete: the record is completed; the delivery is not acked.
	AfterComplete = "after-complete"

	// The windows of a worker on pgstore, whose handler completes the
	// record in the transaction of its effect (see worker's pg mode).

	// InTx: the effect is inserted, the transaction (effect and completed
	// record) is not committed yet.
	InTx = "in-tx"
	// AfterCommit: the transaction is committed (effect and completed
	// record together); the delivery is not acked.
	AfterCommit = "after-commit"
)

// Plan is what the chaos handler does with one message. It travels as the
// message body, in JSON; a body that is not a Plan (empty, binary, huge)
// means the zero Plan: apply at once.
type Plan struct {
	// Op is the operation id, for people reading a queue.
	Op string `json:"op,omitempty"`
	// WorkMS is how long the handler works (honouring its context) before
	// writing the side effect.
	WorkMS int `json:"work_ms,omitempty"`
	// LongUntil, when set, limits WorkMS to the executions whose attempt
	// is below it; later ones do not work.
	LongUntil int `json:"long_until,omitempty"`
	// Crash is a crash window (BeforeEffect, AfterEffect, AfterComplete).
	Crash string `json:"crash,omitempty"`
	// FailUntil makes every execution with an attempt below it fail with a
	// retryable error.
	FailUntil int `json:"fail_until,omitempty"`
	// AlwaysFail makes every execution fail with a retryable error.
	AlwaysFail bool `json:"always_fail,omitempty"`
	// Permanent makes every execution fail with a permanent error.
	Permanent bool `json:"permanent,omitempty"`
	// ResultBytes is the size of the result the handler returns.
	ResultBytes int `json:"result_bytes,omitempty"`
	// Stall makes the first execution (attempt 1) wait, ignoring its
	// context, until another execution has applied the operation (at most
	// StallMS), then write anyway: a stale holder's late write.
	Stall   bool `json:"stall,omitempty"`
	StallMS int  `json:"stall_ms,omitempty"`
}

// Work returns how long the execution with the given attempt works.
func (p Plan) Work(attempt int) time.Duration {
	if p.LongUntil > 0 && attempt >= p.LongUntil {
		return 0
	}
	return time.Duration(p.WorkMS) * time.Millisecond
}

// Body encodes p as a message body.
func (p Plan) Body() []byte {
	b, err := json.Marshal(p)
	if err != nil {
		panic(err) // a Plan always encodes
	}
	return b
}

// ParsePlan decodes a message body; anything that is not a JSON Plan is
// the zero Plan.
func ParsePlan(body []byte) Plan {
	var p Plan
	if len(body) == 0 || body[0] != '{' || len(body) > 1<<16 {
		return Plan{}
	}
	if err := json.Unmarshal(body, &p); err != nil {
		return Plan{}
	}
	return p
}
