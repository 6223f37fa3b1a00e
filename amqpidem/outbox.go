package amqpidem

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The consumer-side outbox: the messages a handler stages are stored with
// its outcome, in the same write, and published, confirmed, before its
// delivery is acked; a delivery that finds them stored but not all
// published publishes the rest first. See Stage.

// ErrNoOutbox is what Stage returns outside the context amqpidem gives a
// handler, once that handler has returned, or when the store cannot keep
// staged messages (it implements no lock.Amender: a wrapper around a
// store must forward Amend): there is no outbox to stage the message in.
var ErrNoOutbox = errors.New("amqpidem: no outbox: Stage needs the context amqpidem gave the handler, while the handler runs")

// ErrOutboxFull is what Stage returns when a message would take the
// outbox past Config.MaxStaged messages, or past what the store keeps in
// one record (its result size limit, less ResultOverhead, the 8-byte
// claim and the message count: whatever Stage accepts is stored with an
// empty result).
var ErrOutboxFull = errors.New("amqpidem: outbox full")

// Stage adds msg, to be published to exchange with routing key key, to the
// outbox of the handler execution ctx belongs to (the handler's context,
// or one derived from it). Nothing is sent while the handler runs.
//
// When the handler succeeds, its staged messages are stored with its
// result, in the same write that completes the record (with pgstore's
// TxHandler, in the handler's transaction); then each is published, with
// mandatory set, and confirmed by the broker, in the order staged; only
// then is the delivery acked. A handler that returns an error, panics,
// returns Permanent, times out or loses its lease publishes nothing it
// staged: its outcome is not stored, and neither are they.
//
// If the process dies between storing and publishing, or a publish fails,
// the delivery comes back, finds the record completed with messages not
// yet published, and publishes those before its ack: each staged message
// is published at least once after its outcome is stored, and the record
// remembers the confirmed ones, so later duplicates publish nothing. A
// message the broker refuses (IsRefused: it returns it, no queue bound, or
// closes the channel over it) is tried again with the delivery, after
// Config.UnavailableDelay, and given up after MaxAttempts tries: logged at
// warn level, counted (Event.Outbox.Returned), and kept in the record
// (OutboxReturned) for an operator to see (amqpidem inspect) and publish
// again (amqpidem outbox redrive). A publish that fails on the way (the
// connection lost, the confirm lost or nacked) is no try: the delivery
// comes back after UnavailableDelay and publishes it again, as often as
// that takes.
//
// msg.MessageId is kept when set. Otherwise it is derived from the
// message's idempotency key and endpoint and its index among the messages
// staged; it is stored with the message, so that every publish of it
// carries the same id and is a duplicate to an amqpidem consumer
// downstream. (Only one execution's staged messages are ever stored: those
// of the execution whose outcome is.) A zero DeliveryMode is made
// Persistent. msg is copied, headers and body included: the caller may
// change it afterwards.
//
// A delivery processed without a key (Config.MissingKey
// ProcessMissingKey, Config.FailOpen) has no record: its staged messages
// are published after the handler succeeds and before the ack, at least
// once, and their MessageIds, when derived, are random.
//
// Stage returns ErrNoOutbox outside a handler's execution or after it
// returned, ErrOutboxFull past Config.MaxStaged messages or the store's
// size limit, and an error saying what is wrong with a message AMQP
// cannot carry (a header value of another type, a name longer than 255
// bytes). It is safe for concurrent use by the handler's goroutines.
func Stage(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	x, ok := ctx.Value(executionKey{}).(*execution)
	if !ok {
		return ErrNoOutbox
	}
	return x.outbox.stage(ctx, exchange, key, msg)
}

// execution is what a handler's context carries: its Info, and the outbox
// its messages are staged in. It is that context too (withExecution): one
// allocation per execution.
type execution struct {
	context.Context // the context the handler's is made from
	info            Info
	outbox          outbox
}

// Value returns x itself for executionKey{}, and otherwise what the
// context it was made from holds: as context.WithValue's context does.
func (x *execution) Value(key any) any {
	if key == (executionKey{}) {
		return x
	}
	return x.Context.Value(key)
}

// String describes the context as context.WithValue's String does,
// without printing the execution's fields (which the handler's goroutines
// may be changing).
func (x *execution) String() string {
	parent := fmt.Sprintf("%T", x.Context)
	if s, ok := x.Context.(fmt.Stringer); ok {
		parent = s.String()
	}
	return parent + ".WithValue(amqpidem.executionKey, *amqpidem.execution)"
}

type executionKey struct{}

// outbox holds the messages one execution staged, encoded (appendPublishing),
// until its outcome is stored. Safe for concurrent use.
type outbox struct {
	// idBase derives the MessageIds of messages staged without one: the
	// record's key, or "" for an execution without one (random ids).
	idBase string
	// maxMessages and maxBytes bound what can be staged (Config.MaxStaged,
	// and what the store keeps in one record).
	maxMessages, maxBytes int
	// noStore says that the record cannot keep staged messages: the
	// store cannot amend records (lock.Amender).
	noStore bool
	// inject writes the trace context of Stage's context into a staged
	// message's headers (Tracer.Inject), so that its record keeps it and
	// every publish of it carries it; nil without a Tracer.
	inject func(ctx context.Context, h amqp.Table)

	mu     sync.Mutex
	sealed bool     // the handler returned: nothing more is staged
	msgs   [][]byte // encoded messages, in the order staged
	size   int      // the bytes msgs take in the stored value
}

// stage encodes and adds one message, staged under ctx; see Stage.
func (o *outbox) stage(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if o.inject != nil {
		h := make(amqp.Table, len(msg.Headers)+2)
		for k, v := range msg.Headers {
			h[k] = v
		}
		o.inject(ctx, h)
		msg.Headers = h
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case o.sealed:
		return ErrNoOutbox
	case o.noStore:
		return fmt.Errorf("%w: the store cannot keep staged messages: it implements no lock.Amender (a wrapper must forward Amend)", ErrNoOutbox)
	case len(o.msgs) >= o.maxMessages:
		return fmt.Errorf("%w: %d messages staged, at most %d (Config.MaxStaged)", ErrOutboxFull, len(o.msgs), o.maxMessages)
	}
	if msg.MessageId == "" {
		msg.MessageId = o.messageID(len(o.msgs))
	}
	if msg.DeliveryMode == 0 {
		msg.DeliveryMode = amqp.Persistent
	}
	enc, err := appendPublishing(nil, exchange, key, msg)
	if err != nil {
		return fmt.Errorf("amqpidem: Stage: %w", err)
	}
	if size := o.size + entrySize(len(enc)); size > o.maxBytes {
		return fmt.Errorf("%w: %d bytes staged, the store keeps at most %d in one record with the result", ErrOutboxFull, size, o.maxBytes)
	}
	o.msgs = append(o.msgs, enc)
	o.size += entrySize(len(enc))
	return nil
}

// seal ends staging and returns what was staged.
func (o *outbox) seal() [][]byte {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.sealed = true
	return o.msgs
}

// messageID is the MessageId of the index-th message staged without one:
// "amqpidem-" and 32 hex digits of a digest of the record's key and the
// index, or random ones without a key.
func (o *outbox) messageID(index int) string {
	var sum [32]byte
	if o.idBase == "" {
		_, _ = rand.Read(sum[:16])
	} else {
		sum = sha256.Sum256([]byte(o.idBase + "\x00outbox\x00" + strconv.Itoa(index)))
	}
	return "amqpidem-" + hex.EncodeToString(sum[:16])
}

// OutboxState is what became of a staged message, as its record keeps it.
type OutboxState uint8

// The states of a staged message.
const (
	// OutboxPending: stored with the outcome, not confirmed by the broker
	// yet. The next delivery of its message publishes it.
	OutboxPending OutboxState = iota
	// OutboxPublished: published and confirmed.
	OutboxPublished
	// OutboxReturned: given up after the broker returned it (no queue
	// bound) or refused it (IsRefused) MaxAttempts times. It stays in the
	// record; `amqpidem outbox redrive` publishes it again.
	OutboxReturned
)

// String returns the state in lower case, as logged.
func (s OutboxState) String() string {
	switch s {
	case OutboxPending:
		return "pending"
	case OutboxPublished:
		return "published"
	case OutboxReturned:
		return "returned"
	}
	return fmt.Sprintf("outbox_state(%d)", int(s))
}

// OutboxMessage is a message a handler staged, as its record keeps it.
type OutboxMessage struct {
	Exchange   string          // the exchange it is published to
	RoutingKey string          // its routing key
	Msg        amqp.Publishing // the message, as a consumer receives it
	State      OutboxState     // what became of it
	// Tries counts the publishes of it the broker returned or refused
	// (IsRefused); publishes that failed on the way are not counted.
	Tries int
}

// StoredOutbox returns the messages staged with the outcome whose stored
// value is value (lock.Record.Value of a completed record), in the order
// staged: none for a value without, or one amqpidem did not write. It
// returns an error for a value whose outbox is damaged.
func StoredOutbox(value []byte) ([]OutboxMessage, error) {
	v, err := splitValue(value)
	if err != nil || len(v.outbox) == 0 {
		return nil, err
	}
	out := make([]OutboxMessage, len(v.outbox))
	for i, e := range v.outbox {
		ex, key, msg, _, err := readPublishing(e.msg)
		if err != nil {
			return nil, fmt.Errorf("amqpidem: staged message %d: %w", i, err)
		}
		out[i] = OutboxMessage{Exchange: ex, RoutingKey: key, Msg: msg, State: e.state, Tries: int(e.tries)}
	}
	return out, nil
}

// SetOutboxState returns a copy of value, a stored value StoredOutbox
// reads, with the index-th staged message in state s and its tries reset
// to 0 for OutboxPending: what an operator's tool amends a record with
// (lock.Amender) after publishing a returned message again.
func SetOutboxState(value []byte, index int, s OutboxState) ([]byte, error) {
	v, err := splitValue(value)
	if err != nil {
		return nil, err
	}
	if index < 0 || index >= len(v.outbox) {
		return nil, fmt.Errorf("amqpidem: staged message %d: the value has %d", index, len(v.outbox))
	}
	out := append([]byte(nil), value...)
	e := v.outbox[index]
	out[e.at] = byte(s)
	if s == OutboxPending {
		out[e.at+1] = 0
	}
	return out, nil
}

// OutboxClaim returns until when the claim on publishing the staged
// messages of value (a stored value StoredOutbox reads) holds: taken by
// the execution that stored them, by a copy of their message publishing
// them again, or by an operator's tool (ClaimOutbox). It returns the zero
// Time when nobody holds it (an execution done publishing gives it up),
// or when value has no staged messages, and an error for a value whose
// outbox is damaged.
func OutboxClaim(value []byte) (time.Time, error) {
	v, err := splitValue(value)
	if err != nil || len(v.outbox) == 0 || v.claimUntil <= 0 {
		return time.Time{}, err
	}
	return time.UnixMilli(v.claimUntil), nil
}

// ClaimOutbox returns a copy of value (a stored value with staged
// messages) whose claim on publishing them holds until until, a claim of
// the caller's own, as a copy of their message takes it; a zero until
// gives the claim up. Amend the record with it (lock.Amender,
// compare-and-set on value) and publish only once that succeeded, and
// only while the claim holds: the copies of the message, and other
// tools, that find the claim held publish nothing until it passes. It
// returns an error for a value without staged messages, or whose outbox
// is damaged.
func ClaimOutbox(value []byte, until time.Time) ([]byte, error) {
	v, err := splitValue(value)
	if err != nil {
		return nil, err
	}
	if len(v.outbox) == 0 {
		return nil, errors.New("amqpidem: ClaimOutbox: the value has no staged messages")
	}
	out := append([]byte(nil), value...)
	claim := uint64(0)
	if !until.IsZero() {
		claim = newClaim(until.UnixMilli())
	}
	binary.BigEndian.PutUint64(out[v.claimAt:], claim)
	return out, nil
}

// The stored value of a completed record, as amqpidem writes it:
//
//	version 1: [1][flags][digest?] result
//	version 2: [2][flags][digest?][claim][n][n entries] result
//
// flags has flagReplyTo when a 16-byte digest of the reply's ReplyTo
// follows. Version 2, written only when the handler staged messages, adds
// the outbox: the claim, 8 bytes (see claimUntil), saying who publishes
// the messages and until when; n, a uvarint; then per message its state
// (OutboxState, one byte), its tries (one byte), the length of its
// encoding (uvarint) and the encoding (appendPublishing). amqpidem
// changes the claim, state and tries bytes only (lock.Amender), never the
// length of a value.
const outboxVersion = 2

// The claim of a version 2 value is a big-endian uint64 in one of two
// forms:
//
//   - plain: until when (ms since the epoch, by the writer's clock) the
//     execution that stored the value publishes its messages itself, or 0
//     once nobody holds the claim. The storing execution writes it, with
//     its completion; so did copies before claims were tagged.
//   - tagged (claimTagged set): a copy's claim, taken by compare-and-set
//     (lock.Amender) from the value it read. The claim's end, in ms since
//     the epoch, takes the 43 bits below claimTagged (to the year 2248),
//     and the low claimTagBits bits are the claimant's tag (newClaim), so
//     that two copies taking the claim from one value at the same
//     millisecond write different bytes: Amend answers nil to a writer
//     whose bytes the record already holds, and without the tag both such
//     copies won, and both published.
//
// A consumer of a release before tagged claims reads a tagged claim as a
// negative time, long passed: it takes the claim over at once and
// publishes the pending messages, possibly while the copy that holds the
// claim publishes them too. During a rolling upgrade, a message can so be
// published twice, with the same MessageId (a duplicate that an amqpidem
// consumer downstream drops); nothing is lost or held back, and a value
// such a consumer writes, with a plain claim, is read as before.
const (
	claimTagged  = uint64(1) << 63
	claimTagBits = 20
)

// claimTags is where newClaim's tags come from: a random start, then one
// more per claim.
var claimTags = func() *atomic.Uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	var n atomic.Uint64
	n.Store(binary.BigEndian.Uint64(b[:]))
	return &n
}()

// newClaim is a copy's tagged claim until until (ms since the epoch).
// Claims of one process differ in their tag for 2^claimTagBits claims in
// a row; those of two processes taken at the same millisecond have the
// same tag with odds of 1 in 2^claimTagBits.
func newClaim(until int64) uint64 {
	tag := claimTags.Add(1) & (1<<claimTagBits - 1)
	return claimTagged | (uint64(max(until, 0))<<claimTagBits)&^claimTagged | tag
}

// claimUntil is until when claim, in either form, holds (ms since the
// epoch): 0 when nobody holds it.
func claimUntil(claim uint64) int64 {
	if claim&claimTagged != 0 {
		return int64((claim &^ claimTagged) >> claimTagBits)
	}
	return int64(claim)
}

// entrySize is what a message of n encoded bytes takes in the outbox.
func entrySize(n int) int {
	return 2 + uvarintLen(n) + n
}

func uvarintLen(n int) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutUvarint(b[:], uint64(n))
}

// claimLen is the size of the claim in a version 2 value.
const claimLen = 8

// outboxLimit is how many bytes the staged messages (entrySize each) may
// take in a stored value of at most limit bytes, up to maxStaged of them:
// limit less everything else a version 2 value holds but the result, at
// its largest (a reply digest, the claim, the count of maxStaged). So
// whatever Stage accepts fits in the store with an empty result; a result
// fits beside it when it fits in what is left.
func outboxLimit(limit, maxStaged int) int {
	return limit - ResultOverhead - claimLen - uvarintLen(maxStaged)
}

// outboxEntry is one staged message in a stored value.
type outboxEntry struct {
	at    int // offset of its state byte in the value; tries follows
	state OutboxState
	tries uint8
	msg   []byte // its encoding, a slice of the value
}

// storedValue is a stored value split into its parts.
type storedValue struct {
	replyDigest []byte // nil without
	// claimAt is the offset of the claim in the value (version 2), and
	// claimUntil until when it holds (ms since the epoch; 0: nobody
	// holds it).
	claimAt    int
	claimUntil int64
	outbox     []outboxEntry
	result     []byte
}

// encodeValue makes the stored value of a completed message: the result,
// a digest of the ReplyTo its reply went to (so that a stored reply is
// re-sent to that same ReplyTo only), and the staged messages, all
// pending, claimed until claimUntil (ms since the epoch), a plain claim:
// the storing execution's.
func encodeValue(replyTo string, result []byte, staged [][]byte, claimUntil int64) []byte {
	version, flags := byte(resultVersion), byte(0)
	if len(staged) > 0 {
		version = outboxVersion
	}
	if replyTo != "" {
		flags |= flagReplyTo
	}
	n := 2 + len(result)
	if replyTo != "" {
		n += replyDigestLen
	}
	if len(staged) > 0 {
		n += claimLen + uvarintLen(len(staged))
		for _, m := range staged {
			n += entrySize(len(m))
		}
	}
	v := make([]byte, 0, n)
	v = append(v, version, flags)
	if replyTo != "" {
		v = append(v, replyDigest(replyTo)...)
	}
	if len(staged) > 0 {
		v = binary.BigEndian.AppendUint64(v, uint64(claimUntil))
		v = binary.AppendUvarint(v, uint64(len(staged)))
		for _, m := range staged {
			v = append(v, byte(OutboxPending), 0)
			v = binary.AppendUvarint(v, uint64(len(m)))
			v = append(v, m...)
		}
	}
	return append(v, result...)
}

// claim is until when the delivery's execution claims the publishing of
// the messages it stages (ms since the epoch): a lease TTL from now, as
// long as a crashed holder's lease would block its key. Only copies of
// the message read it, to publish those messages a second time only once
// the claim has passed; a clock ahead or behind only brings that forward
// or puts it off.
func (f *flight) claim() int64 {
	return claimFrom(time.Now(), f.lease.TTL)
}

// claimTTL is how long a copy that publishes staged messages claims them:
// Config.LeaseTTL, else DefaultLeaseTTL.
func (p *processor) claimTTL() time.Duration {
	return cmp.Or(p.cfg.LeaseTTL, DefaultLeaseTTL)
}

// claimFrom is the claim of messages stored at now under a lease of ttl.
func claimFrom(now time.Time, ttl time.Duration) int64 {
	return now.Add(ttl).UnixMilli()
}

// errBadValue means a stored value of amqpidem's form is damaged.
var errBadValue = errors.New("amqpidem: stored value damaged")

// splitValue splits a stored value. A value of another form (written by
// something other than amqpidem) is all result, with no reply digest and
// no outbox; a version 2 value whose outbox cannot be read is an error.
func splitValue(v []byte) (storedValue, error) {
	switch {
	case len(v) >= 2 && (v[0] == resultVersion || v[0] == outboxVersion) && v[1] == 0:
		return readOutbox(storedValue{}, v, 2, v[0] == outboxVersion)
	case len(v) >= ResultOverhead && (v[0] == resultVersion || v[0] == outboxVersion) && v[1] == flagReplyTo:
		return readOutbox(storedValue{replyDigest: v[2:ResultOverhead]}, v, ResultOverhead, v[0] == outboxVersion)
	}
	return storedValue{result: v}, nil
}

// readOutbox reads the outbox of v from offset at, when hasOutbox, and
// the result after it.
func readOutbox(s storedValue, v []byte, at int, hasOutbox bool) (storedValue, error) {
	if !hasOutbox {
		s.result = v[at:]
		return s, nil
	}
	if len(v)-at < claimLen {
		return storedValue{}, fmt.Errorf("%w: outbox claim", errBadValue)
	}
	s.claimAt, s.claimUntil = at, claimUntil(binary.BigEndian.Uint64(v[at:]))
	at += claimLen
	n, w := binary.Uvarint(v[at:])
	if w <= 0 || n == 0 || n > uint64(len(v)-at)/2 {
		return storedValue{}, fmt.Errorf("%w: outbox count", errBadValue)
	}
	at += w
	s.outbox = make([]outboxEntry, 0, n)
	for i := uint64(0); i < n; i++ {
		if len(v)-at < 3 {
			return storedValue{}, fmt.Errorf("%w: staged message %d truncated", errBadValue, i)
		}
		e := outboxEntry{at: at, state: OutboxState(v[at]), tries: v[at+1]}
		if e.state > OutboxReturned {
			return storedValue{}, fmt.Errorf("%w: staged message %d in state %d", errBadValue, i, e.state)
		}
		size, w := binary.Uvarint(v[at+2:])
		if w <= 0 || size > uint64(len(v)-at-2-w) {
			return storedValue{}, fmt.Errorf("%w: staged message %d length", errBadValue, i)
		}
		start := at + 2 + w
		e.msg = v[start : start+int(size)]
		s.outbox = append(s.outbox, e)
		at = start + int(size)
	}
	s.result = v[at:]
	return s, nil
}
