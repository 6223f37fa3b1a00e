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

	// The windows of a stage A worker (worker.Config.StageTo), whose
	// handler stages a message for stage B (amqpidem.Stage). On stage A,
	// AfterComplete and AfterCommit are "stored, not published": the
	// record holds the staged message, pending, and the processor
	// publishes it right after.

	// AfterPublish: the staged message is published and confirmed; the
	// record does not say so yet (before amqpidem's Amend).
	AfterPublish = "after-publish"
	// AfterAmend: the record says the message is published; the delivery
	// is not acked.
	AfterAmend = "after-amend"
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
	// Crash is a crash window (BeforeEffect, AfterEffect, AfterComplete;
	// InTx and AfterCommit in pg mode; AfterPublish and AfterAmend on
	// stage A).
	Crash string `json:"crash,omitempty"`
	// Stop is a window where the consumer process stops itself (SIGSTOP,
	// once per operation and window) for the test to continue it: stage
	// A's AfterComplete, AfterCommit and AfterPublish.
	Stop string `json:"stop,omitempty"`
	// FailUntil makes every execution with an attempt below it fail with a
	// retryable error.
	FailUntil int `json:"fail_until,omitempty"`
	// AlwaysFail makes every execution fail with a retryable error.
	AlwaysFail bool `json:"always_fail,omitempty"`
	// Permanent makes every execution fail with a permanent error.
	Permanent bool `json:"permanent,omitempty"`
	// Broken makes every execution fail with a permanent error until the
	// handler is fixed (a worker with Config.Fixed, as after a deploy):
	// the operation is dead-lettered, and applied once an operator
	// replays it to fixed consumers. Only the Redis store's handler
	// (handler.go) follows it.
	Broken bool `json:"broken,omitempty"`
	// ResultBytes is the size of the result the handler returns.
	ResultBytes int `json:"result_bytes,omitempty"`
	// Stall makes the first execution (attempt 1) wait, ignoring its
	// context, until another execution has applied the operation (at most
	// StallMS), then write anyway: a stale holder's late write.
	Stall   bool `json:"stall,omitempty"`
	StallMS int  `json:"stall_ms,omitempty"`

	// Next is, for a stage A worker, the plan of the message its handler
	// stages for stage B (its Op and Origin are set by the handler); nil:
	// the zero Plan.
	Next *Plan `json:"next,omitempty"`
	// StageID is the MessageId a stage A handler sets on the message it
	// stages; empty: none, and amqpidem derives one from the key.
	StageID string `json:"stage_id,omitempty"`
	// Origin, set in the plan a stage A handler stages, names the
	// execution that staged it. A worker handling a plan with an Origin
	// takes the operation id from Op, not from the message's key (which
	// is the staged message's MessageId).
	Origin *Origin `json:"origin,omitempty"`
}

// Origin is the stage A execution that staged a message.
type Origin struct {
	Exec    string `json:"exec"`
	Fence   int64  `json:"fence"`
	Attempt int    `json:"attempt"`
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
