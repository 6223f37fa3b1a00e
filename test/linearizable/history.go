package linearizable

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// Kind names an operation of the store.
type Kind string

// The operations a Recorder records.
const (
	KindAcquire  Kind = "acquire"
	KindExtend   Kind = "extend"
	KindComplete Kind = "complete"
	KindFail     Kind = "fail"
	KindRelease  Kind = "release"
	KindCancel   Kind = "cancel"
	KindAmend    Kind = "amend"
	KindInspect  Kind = "inspect"
	KindForget   Kind = "forget"
)

// ErrKind classifies an operation's error for the model.
type ErrKind string

// The classes of errors. Ambiguous results (ErrUnavailable, a context's
// deadline, anything the stores do not document) may or may not have
// taken effect; the others are definite.
const (
	ErrNone      ErrKind = ""
	ErrLost      ErrKind = "lease_lost"
	ErrChanged   ErrKind = "changed"
	ErrNotFound  ErrKind = "not_found"
	ErrAmbiguous ErrKind = "ambiguous"
	// ErrOther is an error no store documents for the workload's calls
	// (ErrBadRecord, say). The model treats it as ambiguous; Run counts
	// it and reports it.
	ErrOther ErrKind = "other"
)

// Classify maps an error of a store method to its ErrKind.
func Classify(err error) ErrKind {
	switch {
	case err == nil:
		return ErrNone
	case errors.Is(err, lock.ErrUnavailable), errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return ErrAmbiguous
	case errors.Is(err, lock.ErrLeaseLost):
		return ErrLost
	case errors.Is(err, lock.ErrChanged):
		return ErrChanged
	case errors.Is(err, lock.ErrNotFound):
		return ErrNotFound
	}
	return ErrOther
}

// Input is what an operation was asked: the fields its Kind uses.
type Input struct {
	// Kind is the method called.
	Kind Kind `json:"kind"`
	// Key is the idempotency key.
	Key string `json:"key"`
	// Owner and Fence identify the lease of Extend, Complete, Fail,
	// Release and Cancel; Fence is the fence of Amend and Forget.
	Owner string `json:"owner,omitempty"`
	// Fence is the lease's or the record's fence.
	Fence int64 `json:"fence,omitempty"`
	// TTL is the lease TTL of Acquire and Extend.
	TTL time.Duration `json:"ttl,omitempty"`
	// Fingerprint is Acquire's payload fingerprint.
	Fingerprint string `json:"fp,omitempty"`
	// Value is Complete's result, Fail's reason, Amend's new value.
	Value string `json:"value,omitempty"`
	// Old is Amend's expected value.
	Old string `json:"old,omitempty"`
	// State is Forget's expected state.
	State lock.State `json:"state,omitempty"`
	// Call is when the call was made, in ns since the recorder began.
	Call int64 `json:"call"`
}

// Output is what an operation answered.
type Output struct {
	// Err classifies the error; ErrNone when the call succeeded.
	Err ErrKind `json:"err,omitempty"`
	// Error is the error's text, for the visualization.
	Error string `json:"error,omitempty"`
	// Status, Owner, Fence, Attempts, Value (Value or Error of the
	// Result) describe Acquire's Result; Owner is the lease's.
	Status lock.Status `json:"status,omitempty"`
	// Owner is the granted lease's owner, or the record's (Inspect).
	Owner string `json:"owner,omitempty"`
	// Fence is the lease's or the record's fence.
	Fence int64 `json:"fence,omitempty"`
	// Attempts is Result.Attempts or Record.Attempts.
	Attempts int `json:"attempts,omitempty"`
	// Value is the stored result (Completed, Inspect) or error text.
	Value string `json:"value,omitempty"`
	// State is Inspect's record state.
	State lock.State `json:"state,omitempty"`
	// Return is when the call returned, in ns since the recorder began.
	Return int64 `json:"return"`
}

// Op is one recorded operation.
type Op struct {
	// Client is the client that called it.
	Client int `json:"client"`
	// In is the call.
	In Input `json:"in"`
	// Out is the answer.
	Out Output `json:"out"`
}

// Store is what a Recorder wraps: a store with its admin and amend methods.
type Store interface {
	lock.Store
	lock.Admin
	lock.Amender
}

// Recorder records the operations of its clients on a store.
type Recorder struct {
	store Store
	start time.Time

	mu  sync.Mutex
	ops []Op
}

// NewRecorder returns a recorder of operations on s; times count from now.
func NewRecorder(s Store) *Recorder { return &Recorder{store: s, start: time.Now()} }

// Client returns client id's view of the store: every call through it is
// recorded as id's.
func (r *Recorder) Client(id int) *Client { return &Client{r: r, id: id} }

// Now returns the recorder's clock: ns since it was made (monotonic).
func (r *Recorder) Now() int64 { return int64(time.Since(r.start)) }

// History returns a copy of the operations recorded so far.
func (r *Recorder) History() []Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Op(nil), r.ops...)
}

// Len returns how many operations were recorded so far.
func (r *Recorder) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ops)
}

func (r *Recorder) add(op Op) {
	r.mu.Lock()
	r.ops = append(r.ops, op)
	r.mu.Unlock()
}

// Client is one client's recorded view of a store. It implements Store.
type Client struct {
	r  *Recorder
	id int
}

var _ Store = (*Client)(nil)

func (c *Client) record(in Input, out Output, err error) {
	out.Return = c.r.Now()
	out.Err = Classify(err)
	if err != nil {
		out.Error = err.Error()
	}
	c.r.add(Op{Client: c.id, In: in, Out: out})
}

// Acquire calls the store's Acquire and records it.
func (c *Client) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	in := Input{Kind: KindAcquire, Key: req.Key, TTL: req.TTL, Fingerprint: req.Fingerprint, Call: c.r.Now()}
	res, err := c.r.store.Acquire(ctx, req)
	out := Output{Status: res.Status, Fence: res.Fence, Attempts: res.Attempts}
	switch res.Status {
	case lock.Acquired:
		out.Owner, out.Fence, out.Attempts = res.Lease.Owner, res.Lease.Fence, res.Lease.Attempt
	case lock.Completed:
		out.Value = string(res.Value)
	case lock.Failed:
		out.Value = res.Error
	}
	c.record(in, out, err)
	return res, err
}

// Extend calls the store's Extend and records one operation per lease.
func (c *Client) Extend(ctx context.Context, leases ...lock.Lease) []error {
	call := c.r.Now()
	errs := c.r.store.Extend(ctx, leases...)
	for i, l := range leases {
		var err error
		if i < len(errs) {
			err = errs[i]
		}
		c.record(Input{Kind: KindExtend, Key: l.Key, Owner: l.Owner, Fence: l.Fence, TTL: l.TTL, Call: call}, Output{}, err)
	}
	return errs
}

func (c *Client) finish(kind Kind, l lock.Lease, value string, f func() error) error {
	in := Input{Kind: kind, Key: l.Key, Owner: l.Owner, Fence: l.Fence, Value: value, Call: c.r.Now()}
	err := f()
	c.record(in, Output{}, err)
	return err
}

// Complete calls the store's Complete and records it.
func (c *Client) Complete(ctx context.Context, l lock.Lease, result []byte) error {
	return c.finish(KindComplete, l, string(result), func() error { return c.r.store.Complete(ctx, l, result) })
}

// Fail calls the store's Fail and records it.
func (c *Client) Fail(ctx context.Context, l lock.Lease, reason string) error {
	return c.finish(KindFail, l, reason, func() error { return c.r.store.Fail(ctx, l, reason) })
}

// Release calls the store's Release and records it.
func (c *Client) Release(ctx context.Context, l lock.Lease) error {
	return c.finish(KindRelease, l, "", func() error { return c.r.store.Release(ctx, l) })
}

// Cancel calls the store's Cancel and records it.
func (c *Client) Cancel(ctx context.Context, l lock.Lease) error {
	return c.finish(KindCancel, l, "", func() error { return c.r.store.Cancel(ctx, l) })
}

// Amend calls the store's Amend and records it.
func (c *Client) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	in := Input{Kind: KindAmend, Key: key, Fence: fence, Old: string(old), Value: string(value), Call: c.r.Now()}
	err := c.r.store.Amend(ctx, key, fence, old, value)
	c.record(in, Output{}, err)
	return err
}

// Inspect calls the store's Inspect and records it.
func (c *Client) Inspect(ctx context.Context, key string) (lock.Record, error) {
	in := Input{Kind: KindInspect, Key: key, Call: c.r.Now()}
	rec, err := c.r.store.Inspect(ctx, key)
	out := Output{State: rec.State, Owner: rec.Owner, Fence: rec.Fence, Attempts: rec.Attempts}
	switch rec.State {
	case lock.StateCompleted:
		out.Value = string(rec.Value)
	case lock.StateFailed:
		out.Value = rec.Error
	}
	c.record(in, out, err)
	return rec, err
}

// Forget calls the store's Forget and records it.
func (c *Client) Forget(ctx context.Context, key string, state lock.State, fence int64) error {
	in := Input{Kind: KindForget, Key: key, State: state, Fence: fence, Call: c.r.Now()}
	err := c.r.store.Forget(ctx, key, state, fence)
	c.record(in, Output{}, err)
	return err
}
