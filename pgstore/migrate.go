package pgstore

// MigrationSQL, DropSQL and Migrate: making and removing what a Store
// needs in the database (schema.go has the statements).

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// MigrationSQL returns the SQL that Migrate runs for cfg: the records
// table, its index and its functions, and the producer outbox's table
// and its indexes, each created only if missing (the functions are
// replaced). Apply it with your own migration tool if you
// prefer; Check tells whether a database has it.
func MigrationSQL(cfg Config) (string, error) {
	if err := cfg.Validate(); err != nil {
		return "", err
	}
	cfg = cfg.withDefaults()
	n := cfg.names()
	sql := strings.NewReplacer(
		"{table}", n.table,
		"{acquire}", n.acquire,
		"{finish}", n.finish,
		"{finishtx}", n.finishTx,
		"{acquireheld}", n.acquireHeld,
		"{finishheld}", n.finishHeld,
		"{heldkey}", n.heldKey,
		"{heldkeyhash}", heldKeyHash(n.table),
		"{heldlock}", heldLockClass+", "+heldKeyHash(n.table),
		"{leaselost}", leaseLostCode,
		"{index}", n.index,
		"{checkformat}", formatCheck(n.table, tableComment),
		"{clockus}", clockUS,
		"{locktimeout}", lockTimeout,
		"{outbox}", n.outbox,
		"{outboxpending}", n.outboxPending,
		"{outboxkeys}", n.outboxKeys,
		"{outboxorder}", n.outboxOrder,
		"{outboxsent}", n.outboxSent,
		"{outboxdead}", n.outboxDead,
		"{outboxdeadorder}", n.outboxDeadOrder,
		"{upgradeoutbox}", strings.NewReplacer(
			"{outbox}", n.outbox,
			"{outboxkeys}", n.outboxKeys,
			"{outboxliteral}", literal(n.outbox),
			"{comment1}", literal(outboxComment1),
			"{comment}", literal(outboxComment),
		).Replace(upgradeOutboxSQL),
		"{checkoutboxformat}", formatCheck(n.outbox, outboxComment),
	).Replace(migrationSQL + outboxSQL)
	if cfg.Schema != "" {
		sql = "CREATE SCHEMA IF NOT EXISTS " + pgx.Identifier{cfg.Schema}.Sanitize() + ";\n" + sql
	}
	return sql, nil
}

// DropSQL returns the SQL that removes everything Migrate(cfg) creates
// (see Migrate): the functions, then the tables, with their indexes and
// the outbox's id sequence. Each statement is IF EXISTS, so it also runs
// on a database only partly migrated. The schema (Config.Schema) stays: it
// may hold other objects. Every record and every outbox message is lost:
// stop the consumers, writers and relays of the tables first.
func DropSQL(cfg Config) (string, error) {
	if err := cfg.Validate(); err != nil {
		return "", err
	}
	n := cfg.withDefaults().names()
	var b strings.Builder
	for _, fn := range []string{n.acquire, n.finish, n.finishTx, n.acquireHeld, n.finishHeld, n.heldKey} {
		b.WriteString("DROP FUNCTION IF EXISTS " + fn + ";\n")
	}
	for _, table := range []string{n.table, n.outbox, n.outboxKeys} {
		b.WriteString("DROP TABLE IF EXISTS " + table + ";\n")
	}
	return b.String(), nil
}

// heldLockClass is the first half of the key of a record's
// transaction-level advisory lock: "amqi", apart from other programs'
// advisory locks.
const heldLockClass = "1634562409"

// Migrate creates, in one transaction, what a Store configured with cfg
// needs, and the producer outbox (Outbox, Relay) beside it, whether or not
// the program uses it: MigrationSQL(cfg). With the default names, in
// Config.Schema (created if missing) or the first schema of the
// search_path:
//
//   - the records table amqpidem_records (Config.Table), its index
//     amqpidem_records_expires, and its functions amqpidem_records_acquire,
//     _finish, _finish_tx, _acquire_held, _held_key and _finish_held;
//   - the outbox table amqpidem_outbox (Config.OutboxTable), the sequence
//     of its id column (an identity column: amqpidem_outbox_id_seq), its
//     indexes amqpidem_outbox_pending, _order, _sent and _dead, and the
//     table amqpidem_outbox_keys (the order keys' counters).
//
// DropSQL(cfg) removes them all. Migrate is idempotent and safe to run
// from many processes at once (they take turns on an advisory lock). The
// role needs the right to create tables and functions in the schema.
func Migrate(ctx context.Context, pool *pgxpool.Pool, cfg Config) error {
	sql, err := MigrationSQL(cfg)
	if err != nil {
		return err
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(migrateLock)); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, sql)
		return err
	})
	if err != nil {
		return fmt.Errorf("pgstore: migrate: %w", classify(err))
	}
	return nil
}
