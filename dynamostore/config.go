package dynamostore

import (
	"errors"
	"fmt"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// Defaults applied by Config.withDefaults, and limits.
const (
	// DefaultTable is the records table when Config.Table is empty.
	DefaultTable = "amqpidem_records"
	// DefaultMaxClockSkew is Config.MaxClockSkew's default.
	DefaultMaxClockSkew = time.Second
	// DefaultExtendConcurrency is Config.ExtendConcurrency's default.
	DefaultExtendConcurrency = 16
	// DefaultTTLDelay is Config.TTLDelay's default.
	DefaultTTLDelay = 24 * time.Hour
	// MaxResultSizeLimit is the largest Config.MaxResultSize allowed: a
	// record is one item, and DynamoDB refuses items over 400 KB; the
	// other attributes (the key of up to lock.MaxKeyLen bytes plus the
	// prefix, the fingerprint, owner, numbers and the attribute names) take
	// less than the 4 KB left.
	MaxResultSizeLimit = 396 << 10
)

// Config configures a Store. The zero value is valid: every field has a
// documented default.
type Config struct {
	// Config holds what every store of package lock shares: LeaseTTL,
	// Retention, MaxResultSize (at most MaxResultSizeLimit here), Logger
	// and Now, with the same defaults and limits. Prefix is the namespace
	// of the records: two stores with different prefixes on one table
	// never see each other's records (default lock.DefaultPrefix). Now is
	// the clock leases expire by (see the package doc: DynamoDB has none
	// that a condition can read). Replicas is refused.
	lock.Config
	// Table is the name of the records table (see CreateTable). Default
	// DefaultTable.
	Table string
	// MaxClockSkew is how far apart the clocks of the processes sharing
	// the table may be. An expired lease is taken over only once its
	// deadline is MaxClockSkew in the past by the clock of the process
	// taking it over, so that a holder whose clock is behind by up to that
	// much never sees its lease taken over before its own deadline. Default
	// DefaultMaxClockSkew; negative is an error.
	MaxClockSkew time.Duration
	// ExtendConcurrency bounds how many leases one Extend call renews at
	// once (one conditional UpdateItem each). Default
	// DefaultExtendConcurrency; negative is an error.
	ExtendConcurrency int
	// TTLDelay is how long after a record's expiry its item's TTL attribute
	// lets DynamoDB delete it. Expiry is judged by the store's conditions,
	// never by the item's absence; the item stays only to keep its fence
	// (see the package doc) and for cleanup to be lazy. Default
	// DefaultTTLDelay; below a minute is an error.
	TTLDelay time.Duration
}

// Validate reports the first invalid field, by name.
func (c Config) Validate() error {
	if err := c.Config.Validate(); err != nil {
		return err
	}
	switch {
	case c.Replicas != 0:
		return errors.New("dynamostore: Config.Replicas is for the Redis store; DynamoDB writes are durable in several zones before they are acknowledged")
	case c.MaxResultSize > MaxResultSizeLimit:
		return fmt.Errorf("dynamostore: Config.MaxResultSize %d is above %d: a record is one DynamoDB item, at most 400 KB", c.MaxResultSize, MaxResultSizeLimit)
	case len(c.Table) > 255:
		return fmt.Errorf("dynamostore: Config.Table is %d bytes, at most 255 allowed", len(c.Table))
	case c.Table != "" && len(c.Table) < 3:
		return fmt.Errorf("dynamostore: Config.Table %q is shorter than 3 bytes, which DynamoDB refuses", c.Table)
	case c.MaxClockSkew < 0:
		return fmt.Errorf("dynamostore: Config.MaxClockSkew %v must not be negative", c.MaxClockSkew)
	case c.ExtendConcurrency < 0:
		return fmt.Errorf("dynamostore: Config.ExtendConcurrency %d must not be negative", c.ExtendConcurrency)
	case c.TTLDelay != 0 && c.TTLDelay < time.Minute:
		return fmt.Errorf("dynamostore: Config.TTLDelay %v must be zero (default %v) or at least a minute", c.TTLDelay, DefaultTTLDelay)
	}
	return nil
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	c.Config = c.Config.WithDefaults()
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.MaxClockSkew == 0 {
		c.MaxClockSkew = DefaultMaxClockSkew
	}
	if c.ExtendConcurrency == 0 {
		c.ExtendConcurrency = DefaultExtendConcurrency
	}
	if c.TTLDelay == 0 {
		c.TTLDelay = DefaultTTLDelay
	}
	return c
}
