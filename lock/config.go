package lock

import (
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// Defaults applied by Config.WithDefaults.
const (
	// DefaultPrefix namespaces every Redis key the store writes.
	DefaultPrefix = "amqpidem"
	// DefaultLeaseTTL is the lease duration when neither Config nor the
	// Request sets one.
	DefaultLeaseTTL = 30 * time.Second
	// DefaultRetention is the idempotency window: how long a record is
	// kept after its last change.
	DefaultRetention = 24 * time.Hour
	// maxPrefixLen bounds Config.Prefix.
	maxPrefixLen = 64
)

// Config configures a Store. The zero value is valid: every field has a
// documented default.
type Config struct {
	// Prefix namespaces the store's Redis keys; two stores with different
	// prefixes never see each other's records. At most 64 bytes, no '{' or
	// '}' (they would change the Redis Cluster hash slot). Default
	// DefaultPrefix.
	Prefix string
	// LeaseTTL is the default lease duration. Default DefaultLeaseTTL;
	// below MinTTL (but not zero) is an error.
	LeaseTTL time.Duration
	// Retention is the default idempotency window. Default
	// DefaultRetention; negative, or between 0 and 1ms (which the server
	// would keep as 0: no idempotency at all), is an error.
	Retention time.Duration
	// MaxResultSize limits a stored result (Complete) and stored error
	// text (Fail cuts longer text), in bytes. Default DefaultMaxResultSize;
	// negative is an error.
	MaxResultSize int
	// Logger receives warnings (an eviction policy that can lose leases,
	// a script reloaded after a failover). Default slog.Default();
	// slog.New(slog.DiscardHandler) silences it.
	Logger *slog.Logger
	// Now is the local clock, used only to estimate a lease's deadline
	// conservatively on this side. Lease expiry itself is always judged by
	// the server's clock. Default time.Now.
	Now func() time.Time

	// Replicas, when above zero, makes every write of a RedisStore wait
	// until that many replicas have acknowledged it (Redis WAIT, in the
	// same round trip), at most ReplicaTimeout. When they do not all
	// acknowledge in time, every call of that round trip returns an error
	// wrapping ErrUnavailable (its write is on the primary, maybe not on a
	// replica; a retry finds it and waits again), so a lease is not used, and
	// an outcome not counted as stored, before a failover to an
	// acknowledging replica would keep it. Redis replicates
	// asynchronously: without it, a failover (Sentinel) can forget leases
	// and completed records written just before, and their messages run
	// again. With it, the store is unavailable while fewer replicas than
	// Replicas answer: set it below the number of replicas to keep
	// serving with one down. WAIT does not make a write durable on disk,
	// and a failover to a replica that did not acknowledge still forgets.
	// Without Replicas the store is not linearizable across a failover:
	// test/linearizable's redis-sentinel-failover-nowait run shows a
	// forgotten record coming back with an older fence, and its wait run
	// passes (docs/testing.md).
	// Not for a Redis Cluster client (WAIT is per connection and node) or
	// the other stores: NewRedisStore refuses it there, and MemoryStore
	// and pgstore refuse it (PostgreSQL's synchronous_standby_names is its
	// equivalent). Default 0: no wait.
	Replicas int
	// ReplicaTimeout bounds the wait for Replicas. It must be shorter
	// than the client's read timeout (go-redis: 3 s by default). Default
	// DefaultReplicaTimeout when Replicas is set.
	ReplicaTimeout time.Duration
}

// DefaultReplicaTimeout is Config.ReplicaTimeout's default.
const DefaultReplicaTimeout = time.Second

// Validate reports the first invalid field, by name.
func (c Config) Validate() error {
	switch {
	case len(c.Prefix) > maxPrefixLen:
		return fmt.Errorf("lock: Config.Prefix is %d bytes, at most %d allowed", len(c.Prefix), maxPrefixLen)
	case strings.ContainsAny(c.Prefix, "{}"):
		return fmt.Errorf("lock: Config.Prefix %q must not contain '{' or '}'", c.Prefix)
	case c.LeaseTTL < 0 || (c.LeaseTTL > 0 && c.LeaseTTL < MinTTL):
		return fmt.Errorf("%w: Config.LeaseTTL %v must be zero (default %v) or at least %v", ErrInvalidTTL, c.LeaseTTL, DefaultLeaseTTL, MinTTL)
	case c.Retention < 0 || (c.Retention > 0 && c.Retention < time.Millisecond):
		// Below a millisecond the server would keep nothing: idempotency off.
		return fmt.Errorf("%w: Config.Retention %v must be zero (default %v) or at least 1ms", ErrInvalidTTL, c.Retention, DefaultRetention)
	case c.MaxResultSize < 0:
		return fmt.Errorf("lock: Config.MaxResultSize %d must not be negative", c.MaxResultSize)
	case c.Replicas < 0:
		return fmt.Errorf("lock: Config.Replicas %d must not be negative", c.Replicas)
	case c.ReplicaTimeout < 0 || (c.ReplicaTimeout > 0 && c.ReplicaTimeout < time.Millisecond):
		return fmt.Errorf("lock: Config.ReplicaTimeout %v must be zero (default %v) or at least 1ms", c.ReplicaTimeout, DefaultReplicaTimeout)
	}
	return nil
}

// WithDefaults returns c with every zero field set to its default. Store
// implementations call it once, after Validate.
func (c Config) WithDefaults() Config {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.Retention == 0 {
		c.Retention = DefaultRetention
	}
	if c.MaxResultSize == 0 {
		c.MaxResultSize = DefaultMaxResultSize
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Replicas > 0 && c.ReplicaTimeout == 0 {
		c.ReplicaTimeout = DefaultReplicaTimeout
	}
	return c
}

// CheckRequest validates req against the limits every Store enforces
// (key and fingerprint length, TTL and retention bounds) and fills in c's
// defaults for its TTL and retention, cut to whole milliseconds. c must
// have its defaults (WithDefaults). Store implementations call it first in
// Acquire, so that every store accepts and refuses the same requests.
func (c Config) CheckRequest(req Request) (Request, error) {
	if err := checkKey(req.Key); err != nil {
		return req, err
	}
	if len(req.Fingerprint) > MaxFingerprintLen {
		return req, fmt.Errorf("%w: %d bytes, at most %d allowed", ErrInvalidFingerprint, len(req.Fingerprint), MaxFingerprintLen)
	}
	if req.TTL == 0 {
		req.TTL = c.LeaseTTL
	}
	if req.Retention == 0 {
		req.Retention = c.Retention
	}
	// Checked before the cut to milliseconds below, which would make a
	// retention of -500µs or 500µs a retention of 0: nothing kept.
	if req.Retention < 0 {
		return req, fmt.Errorf("%w: retention %v is negative", ErrInvalidTTL, req.Retention)
	}
	if req.Retention < time.Millisecond {
		return req, fmt.Errorf("%w: retention %v is below 1ms: nothing would be kept", ErrInvalidTTL, req.Retention)
	}
	// The server keeps milliseconds: a lease must not claim more than that,
	// or its local deadline would be later than the server's.
	req.TTL = req.TTL.Truncate(time.Millisecond)
	req.Retention = req.Retention.Truncate(time.Millisecond)
	if req.TTL < MinTTL {
		return req, fmt.Errorf("%w: lease TTL %v is below the minimum %v", ErrInvalidTTL, req.TTL, MinTTL)
	}
	return req, nil
}

// CheckLease rejects a lease no Store could have issued: an invalid key, no
// owner or fence (ErrLeaseLost), a TTL below MinTTL, or a retention below
// 1ms (ErrInvalidTTL), which CheckRequest refuses too: a server keeps
// milliseconds, and would keep the outcome for none, deleting the record.
// Store implementations call it first in Extend, Complete, Fail, Release
// and Cancel.
func CheckLease(l Lease) error {
	if err := checkKey(l.Key); err != nil {
		return err
	}
	if l.Owner == "" || l.Fence <= 0 {
		return fmt.Errorf("%w: key %q: lease has no owner or fence (not from Acquire)", ErrLeaseLost, l.Key)
	}
	if l.TTL < MinTTL {
		return fmt.Errorf("%w: lease TTL %v is below the minimum %v", ErrInvalidTTL, l.TTL, MinTTL)
	}
	if l.Retention < time.Millisecond {
		return fmt.Errorf("%w: lease retention %v is below 1ms: nothing would be kept", ErrInvalidTTL, l.Retention)
	}
	return nil
}

func checkKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	case len(key) > MaxKeyLen:
		return fmt.Errorf("%w: %d bytes, at most %d allowed", ErrInvalidKey, len(key), MaxKeyLen)
	}
	return nil
}
