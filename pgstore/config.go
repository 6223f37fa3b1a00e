package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Defaults applied by Config.withDefaults.
const (
	// DefaultTable is the records table when Config.Table is empty.
	DefaultTable = "amqpidem_records"
	// DefaultCleanupInterval is how often a Store deletes expired records
	// when Config.CleanupInterval is zero.
	DefaultCleanupInterval = time.Minute
	// DefaultCleanupBatch is how many expired records one cleanup
	// statement deletes at most when Config.CleanupBatch is zero.
	DefaultCleanupBatch = 1000
	// DefaultOutboxTable is the producer outbox's table when
	// Config.OutboxTable is empty.
	DefaultOutboxTable = "amqpidem_outbox"
	// maxTableLen leaves room in PostgreSQL's 63-byte identifiers for the
	// suffixes of the functions and the index ("_acquire", "_expires").
	maxTableLen = 50
)

// Config configures a Store, and names what Migrate creates. The zero value
// is valid: every field has a documented default.
type Config struct {
	// Config holds what every store of package lock shares: LeaseTTL,
	// Retention, MaxResultSize, Logger and Now, with the same defaults and
	// limits. Prefix is the namespace of the records: two stores with
	// different prefixes on one table never see each other's records
	// (default lock.DefaultPrefix).
	lock.Config
	// Schema is the schema of the table and its functions. Default empty:
	// unqualified names, resolved through the connection's search_path.
	// Migrate creates it if it does not exist. It must not contain "$" or
	// a NUL byte, nor must Table or OutboxTable (see Validate).
	Schema string
	// Table is the records table. Migrate also creates the functions
	// "<Table>_acquire", "<Table>_finish", "<Table>_finish_tx",
	// "<Table>_finish_held", "<Table>_held_key" and "<Table>_acquire_held"
	// (kept for the previous build) and the index
	// "<Table>_expires" in the same schema. At most 50 bytes. Default
	// DefaultTable.
	Table string
	// TxOptions are the options of the transactions TxHandler begins.
	// Default: the server's default isolation level, READ COMMITTED unless
	// changed. Under REPEATABLE READ or SERIALIZABLE, a handler that runs
	// longer than a heartbeat interval (a third of the lease TTL) fails at
	// the end with a serialization failure (SQLSTATE 40001), because the
	// heartbeat has updated its record meanwhile: the message is retried,
	// and runs into the same failure again. Keep such handlers short, or
	// use READ COMMITTED with explicit row locks (SELECT ... FOR UPDATE).
	// A read-only AccessMode is refused: the record is written in the
	// transaction. Store.TxHandlerWith sets them per handler.
	TxOptions pgx.TxOptions
	// RowLeases makes TxHandler take every lease as Acquire does, a record
	// row committed before its handler runs, rather than holding the
	// lease of a first delivery in the handler's transaction (see "Leases
	// held by transactions" in the package documentation): every
	// execution is counted before it runs, one that crashes on a first
	// delivery included, and the heartbeat renews the lease however long
	// the transaction stays idle, for one more commit per message.
	RowLeases bool
	// CleanupInterval is how often the Store deletes the records whose
	// retention has passed, in batches of CleanupBatch, from a goroutine
	// that Close stops. Default DefaultCleanupInterval; negative turns the
	// background cleanup off (call Cleanup yourself). Expired records are
	// never used, whether or not they were deleted yet.
	CleanupInterval time.Duration
	// CleanupBatch is how many records one cleanup statement deletes at
	// most, so that no statement holds many row locks or runs long.
	// Default DefaultCleanupBatch; negative is an error.
	CleanupBatch int
	// OutboxTable is the producer outbox's table (see Outbox), in Schema.
	// Migrate also creates the table of its order keys' counters,
	// "<OutboxTable>_keys", and its indexes "<OutboxTable>_pending",
	// "<OutboxTable>_order", "<OutboxTable>_sent", "<OutboxTable>_dead"
	// and "<OutboxTable>_dead_order". At most 50 bytes.
	// Default DefaultOutboxTable.
	OutboxTable string
	// Inject, when set, is called by Outbox.Write with its ctx and the
	// message's headers (a copy, never nil) before the message is stored:
	// it writes the writing transaction's trace context into them, so that
	// the consumer's span joins the producer's trace. The method value
	// Inject of an otelamqpidem.Tracer fits.
	Inject func(ctx context.Context, headers amqp.Table)
}

// Validate reports the first invalid field, by name. Table, OutboxTable and
// Schema are quoted wherever they are used, but the migration also puts
// them inside dollar-quoted function bodies and DO blocks ($fn$ ... $fn$),
// which no quoting protects: a name holding "$" is refused, like one
// holding a NUL byte.
func (c Config) Validate() error {
	if err := c.Config.Validate(); err != nil {
		return err
	}
	switch {
	case c.TxOptions.AccessMode == pgx.ReadOnly:
		return errors.New("pgstore: Config.TxOptions.AccessMode is read only, but TxHandler writes the record in the transaction")
	case len(c.Table) > maxTableLen:
		return fmt.Errorf("pgstore: Config.Table is %d bytes, at most %d allowed", len(c.Table), maxTableLen)
	case len(c.OutboxTable) > maxTableLen:
		return fmt.Errorf("pgstore: Config.OutboxTable is %d bytes, at most %d allowed", len(c.OutboxTable), maxTableLen)
	case strings.ContainsRune(c.Table, 0) || strings.ContainsRune(c.Schema, 0) || strings.ContainsRune(c.OutboxTable, 0):
		return errors.New("pgstore: Config.Table, Config.OutboxTable and Config.Schema must not contain a NUL byte")
	case strings.Contains(c.Table, "$"):
		return fmt.Errorf("pgstore: Config.Table %q contains a $: not allowed, it could end the dollar-quoted function bodies of the migration", c.Table)
	case strings.Contains(c.OutboxTable, "$"):
		return fmt.Errorf("pgstore: Config.OutboxTable %q contains a $: not allowed, it could end the dollar-quoted blocks of the migration", c.OutboxTable)
	case strings.Contains(c.Schema, "$"):
		return fmt.Errorf("pgstore: Config.Schema %q contains a $: not allowed, it could end the dollar-quoted function bodies of the migration", c.Schema)
	case c.OutboxTable != "" && c.OutboxTable == c.withDefaults().Table:
		return fmt.Errorf("pgstore: Config.OutboxTable and Config.Table are both %q: they must be two tables", c.OutboxTable)
	case len(c.Schema) > 63:
		return fmt.Errorf("pgstore: Config.Schema is %d bytes, at most 63 allowed", len(c.Schema))
	case c.Replicas != 0:
		return errors.New("pgstore: Config.Replicas is for the Redis store; PostgreSQL waits for its standbys with synchronous_standby_names and synchronous_commit")
	case c.CleanupBatch < 0:
		return fmt.Errorf("pgstore: Config.CleanupBatch %d must not be negative", c.CleanupBatch)
	}
	return nil
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	c.Config = c.Config.WithDefaults()
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.CleanupInterval == 0 {
		c.CleanupInterval = DefaultCleanupInterval
	}
	if c.CleanupBatch == 0 {
		c.CleanupBatch = DefaultCleanupBatch
	}
	if c.OutboxTable == "" {
		c.OutboxTable = DefaultOutboxTable
	}
	return c
}

// names are the quoted, schema-qualified identifiers of what Migrate
// creates.
type names struct {
	table, acquire, finish string
	finishTx               string // finish, raising where finish answers 0
	acquireHeld            string // the previous build's (schema.go)
	heldKey                string // the key of a record's advisory lock
	finishHeld             string // its outcome
	index                  string // unqualified, as CREATE INDEX wants it

	outbox                     string // the producer outbox's table
	outboxKeys                 string // its order keys' counters
	outboxPending, outboxOrder string // its indexes, unqualified
	outboxSent, outboxDead     string
	outboxDeadOrder            string
	// outboxChannel is the channel Outbox.Write notifies and a Relay
	// listens on: the table's name, unqualified (a channel name is one
	// identifier of at most 63 bytes). Outboxes of the same name in two
	// schemas share it: a relay then wakes for the other's rows too, and
	// finds none of its own.
	outboxChannel string
}

func (c Config) names() names {
	qual := func(name string) string {
		if c.Schema == "" {
			return pgx.Identifier{name}.Sanitize()
		}
		return pgx.Identifier{c.Schema, name}.Sanitize()
	}
	return names{
		table:    qual(c.Table),
		acquire:  qual(c.Table + "_acquire"),
		finish:   qual(c.Table + "_finish"),
		finishTx: qual(c.Table + "_finish_tx"),

		acquireHeld: qual(c.Table + "_acquire_held"),
		heldKey:     qual(c.Table + "_held_key"),
		finishHeld:  qual(c.Table + "_finish_held"),
		index:       pgx.Identifier{c.Table + "_expires"}.Sanitize(),

		outbox:          qual(c.OutboxTable),
		outboxPending:   pgx.Identifier{c.OutboxTable + "_pending"}.Sanitize(),
		outboxKeys:      qual(c.OutboxTable + "_keys"),
		outboxOrder:     pgx.Identifier{c.OutboxTable + "_order"}.Sanitize(),
		outboxSent:      pgx.Identifier{c.OutboxTable + "_sent"}.Sanitize(),
		outboxDead:      pgx.Identifier{c.OutboxTable + "_dead"}.Sanitize(),
		outboxDeadOrder: pgx.Identifier{c.OutboxTable + "_dead_order"}.Sanitize(),
		outboxChannel:   c.OutboxTable,
	}
}
