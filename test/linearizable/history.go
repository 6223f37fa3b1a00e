package linearizable

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
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

// Recorder records the operations of its clients on a store. It is safe
// for concurrent use.
type Recorder struct {
	store Store
	start time.Time
	wall  bool     // times from the wall clock (NewFileRecorder)
	file  *os.File // where calls and returns are written, if anywhere

	mu   sync.Mutex
	ops  []Op
	seq  int64
	werr error // the first error writing file
}

// NewRecorder returns a recorder of operations on s; times count from now.
func NewRecorder(s Store) *Recorder { return &Recorder{store: s, start: time.Now()} }

// NewFileRecorder returns a recorder of operations on s that writes every
// call when it is made and every return when it comes to a new file at
// path, one JSON line each (a write of its own, unbuffered), so that a
// process killed in the middle of a call leaves the call without its
// return: ReadHistories reads such a call as one whose answer was lost,
// which may take effect at any time from its call on. Its times are the
// wall clock's (ns since the Unix epoch), which the processes of one
// machine share, so that the files of several processes merge into one
// history. Close closes the file.
func NewFileRecorder(s Store, path string) (*Recorder, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	return &Recorder{store: s, start: time.Now(), wall: true, file: f}, nil
}

// Close closes the recorder's file, if it has one, and returns the first
// error writing it.
func (r *Recorder) Close() error {
	if r.file == nil {
		return nil
	}
	err := r.file.Close()
	r.mu.Lock()
	defer r.mu.Unlock()
	return errors.Join(r.werr, err)
}

// line is one line of a recorder's file: a call (In set) or the return
// (Out set) of the operation Seq.
type line struct {
	Seq int64   `json:"seq"`
	In  *Input  `json:"in,omitempty"`
	Out *Output `json:"out,omitempty"`
}

// write writes l to the recorder's file, if it has one.
func (r *Recorder) write(l line) {
	if r.file == nil {
		return
	}
	b, err := json.Marshal(l)
	if err == nil {
		_, err = r.file.Write(append(b, '\n'))
	}
	if err != nil {
		r.mu.Lock()
		if r.werr == nil {
			r.werr = err
		}
		r.mu.Unlock()
	}
}

// begin numbers the call in and writes it.
func (r *Recorder) begin(in Input) int64 {
	r.mu.Lock()
	r.seq++
	seq := r.seq
	r.mu.Unlock()
	r.write(line{Seq: seq, In: &in})
	return seq
}

// ReadHistories reads the files of file recorders (NewFileRecorder) and
// merges them into one history, the operations of the i-th file recorded
// as client i's. A call written without its return (the process was
// killed during it) is recorded as ambiguous, "no return": it may have
// taken effect at any time from its call on, or never, as Knossos treats
// a crashed client's call. A last line cut short by the kill is ignored.
func ReadHistories(paths ...string) ([]Op, error) {
	var ops []Op
	for client, path := range paths {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		calls := map[int64]int{} // seq → index in ops
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 16<<20)
		for n := 1; sc.Scan(); n++ {
			var l line
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				continue // a line cut short by a kill
			}
			switch {
			case l.In != nil:
				calls[l.Seq] = len(ops)
				ops = append(ops, Op{Client: client, In: *l.In,
					Out: Output{Err: ErrAmbiguous, Error: "no return (the process ended during the call)"}})
			case l.Out != nil:
				i, ok := calls[l.Seq]
				if !ok {
					f.Close()
					return nil, fmt.Errorf("%s:%d: a return of call %d, which has no call line", path, n, l.Seq)
				}
				ops[i].Out = *l.Out
			}
		}
		err = sc.Err()
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	return ops, nil
}

// Client returns client id's view of the store: every call through it is
// recorded as id's.
func (r *Recorder) Client(id int) *Client { return &Client{r: r, id: id} }

// Now returns the recorder's clock: ns since it was made (monotonic), or,
// for a file recorder, ns since the Unix epoch by the wall clock.
func (r *Recorder) Now() int64 {
	if r.wall {
		return time.Now().UnixNano()
	}
	return int64(time.Since(r.start))
}

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

// add records op, the call numbered seq having returned.
func (r *Recorder) add(seq int64, op Op) {
	r.write(line{Seq: seq, Out: &op.Out})
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

// call stamps in with the time and writes it (a file recorder's call
// line); record records its answer.
func (c *Client) call(in Input) (Input, int64) {
	in.Call = c.r.Now()
	return in, c.r.begin(in)
}

func (c *Client) record(seq int64, in Input, out Output, err error) {
	out.Return = c.r.Now()
	out.Err = Classify(err)
	if err != nil {
		out.Error = err.Error()
	}
	c.r.add(seq, Op{Client: c.id, In: in, Out: out})
}

// Acquire calls the store's Acquire and records it.
func (c *Client) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	return c.AcquireBy(ctx, req, c.r.store.Acquire)
}

// AcquireBy records an Acquire of req that acquire answers in the
// store's place: a LeaseTaker's AcquireLease, which takes the store's
// lease its own way.
func (c *Client) AcquireBy(ctx context.Context, req lock.Request, acquire func(context.Context, lock.Request) (lock.Result, error)) (lock.Result, error) {
	in, seq := c.call(Input{Kind: KindAcquire, Key: req.Key, TTL: req.TTL, Fingerprint: req.Fingerprint})
	res, err := acquire(ctx, req)
	out := Output{Status: res.Status, Fence: res.Fence, Attempts: res.Attempts}
	switch res.Status {
	case lock.Acquired:
		out.Owner, out.Fence, out.Attempts = res.Lease.Owner, res.Lease.Fence, res.Lease.Attempt
	case lock.Completed:
		out.Value = string(res.Value)
	case lock.Failed:
		out.Value = res.Error
	}
	c.record(seq, in, out, err)
	return res, err
}

// Extend calls the store's Extend and records one operation per lease.
func (c *Client) Extend(ctx context.Context, leases ...lock.Lease) []error {
	ins := make([]Input, len(leases))
	seqs := make([]int64, len(leases))
	for i, l := range leases {
		ins[i], seqs[i] = c.call(Input{Kind: KindExtend, Key: l.Key, Owner: l.Owner, Fence: l.Fence, TTL: l.TTL})
	}
	errs := c.r.store.Extend(ctx, leases...)
	for i := range leases {
		var err error
		if i < len(errs) {
			err = errs[i]
		}
		c.record(seqs[i], ins[i], Output{}, err)
	}
	return errs
}

// Begin records the call of kind (KindComplete, KindFail, KindRelease or
// KindCancel) ending lease l with value, made outside the store (a
// Completer's HandleComplete, which completes the record in the
// handler's transaction): it writes the call now and returns the function
// to call with its error when it returns.
func (c *Client) Begin(kind Kind, l lock.Lease, value string) func(error) {
	in, seq := c.call(Input{Kind: kind, Key: l.Key, Owner: l.Owner, Fence: l.Fence, Value: value})
	return func(err error) { c.record(seq, in, Output{}, err) }
}

func (c *Client) finish(kind Kind, l lock.Lease, value string, f func() error) error {
	end := c.Begin(kind, l, value)
	err := f()
	end(err)
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
	in, seq := c.call(Input{Kind: KindAmend, Key: key, Fence: fence, Old: string(old), Value: string(value)})
	err := c.r.store.Amend(ctx, key, fence, old, value)
	c.record(seq, in, Output{}, err)
	return err
}

// Inspect calls the store's Inspect and records it.
func (c *Client) Inspect(ctx context.Context, key string) (lock.Record, error) {
	in, seq := c.call(Input{Kind: KindInspect, Key: key})
	rec, err := c.r.store.Inspect(ctx, key)
	out := Output{State: rec.State, Owner: rec.Owner, Fence: rec.Fence, Attempts: rec.Attempts}
	switch rec.State {
	case lock.StateCompleted:
		out.Value = string(rec.Value)
	case lock.StateFailed:
		out.Value = rec.Error
	}
	c.record(seq, in, out, err)
	return rec, err
}

// Forget calls the store's Forget and records it.
func (c *Client) Forget(ctx context.Context, key string, state lock.State, fence int64) error {
	in, seq := c.call(Input{Kind: KindForget, Key: key, State: state, Fence: fence})
	err := c.r.store.Forget(ctx, key, state, fence)
	c.record(seq, in, Output{}, err)
	return err
}
