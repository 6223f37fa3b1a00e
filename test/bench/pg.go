package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// The PostgreSQL variants (issue 11), on the classic queue only. Their
// handler effect is the same plain INSERT of one row into the run's effects
// table:
//
//	pg-unique     amqpidem.Consumer on a pgstore.Store with store.TxHandler:
//	              the effect and the completed record commit in one
//	              transaction; every key new
//	pg-duplicate  the same, every message a duplicate of pg-unique's
//	              completed work (it replays the round's pg-unique keys)
//	pg-naive      what a user writes by hand: a plain consumer that does an
//	              autocommit INSERT INTO idem(key) ... ON CONFLICT DO NOTHING
//	              and, if it inserted, the effect in a transaction of its
//	              own, then acks
//	pg-batch      amqpidem.NewBatchConsumer with store.BatchTxHandler:
//	              batches of up to pgBatchSize messages (prefetch and
//	              concurrency twice that, whatever -prefetch and
//	              -concurrency say), each batch's effects and records in
//	              one transaction; every key new
const (
	pgUnique    variant = "pg-unique"
	pgDuplicate variant = "pg-duplicate"
	pgNaive     variant = "pg-naive"
	pgBatch     variant = "pg-batch"
)

// pgBatchSize is pg-batch's ConsumerConfig.BatchSize.
const pgBatchSize = 100

// isPG says whether v is one of the PostgreSQL variants.
func (v variant) isPG() bool {
	return v == pgUnique || v == pgDuplicate || v == pgNaive || v == pgBatch
}

// defaultPGDSN is the PostgreSQL the bench uses unless PG_DSN or -pg-dsn
// names another: the one scripts/services.sh and docker-compose.yml start.
const defaultPGDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// pgStartHint says what to start when the PostgreSQL of dsn does not
// answer: lines, each ending in a newline.
func pgStartHint(dsn string) string {
	hint := "  the bench goes on without pg-unique, pg-duplicate and pg-naive (-pg=false skips them without this message).\n"
	if dsn != defaultPGDSN {
		return hint + "  Start the PostgreSQL that PG_DSN or -pg-dsn names, or unset them to use the local default\n" +
			"  (" + redactDSN(defaultPGDSN) + ").\n"
	}
	return hint +
		"  Start PostgreSQL 15 on 127.0.0.1:5432 with a database \"test\" that the user postgres reaches without a password:\n" +
		"    bash scripts/services.sh postgres   (as root it runs pg_ctlcluster 15 main start, and createdb test if missing)\n" +
		"  or: docker compose up -d --wait postgres\n" +
		"  or point PG_DSN (or -pg-dsn) at another PostgreSQL.\n"
}

// Names of the tables the run makes, in a schema of its own
// ("amqpidem_bench_<run id>") that is dropped, with everything in it,
// before the bench exits.
const (
	pgRecordsTable = pgstore.DefaultTable // pgstore's records, made by pgstore.Migrate
	pgEffectsTable = "effects"            // every variant's handler effect
	pgIdemTable    = "idem"               // pg-naive's keys
)

// pgEnv is the PostgreSQL side of a run.
type pgEnv struct {
	o      options       // the DSN and session settings of every pool
	admin  *pgxpool.Pool // schema, TRUNCATE, counts, statistics; not traced
	schema string

	version    string
	syncCommit string // synchronous_commit of the variants' sessions
	postmaster int    // pid of the postmaster, 0 if not readable here

	conns int32 // MaxConns of each variant's pool

	// The pool every pg run shares with -pg-pool-per-run=false, made by
	// the first; closed by close.
	shared    *pgxpool.Pool
	sharedTr  *pgTracer
	sharedApp string

	records, effects, idem string // quoted, schema-qualified table names
	effectSQL, idemSQL     string

	dropped bool // the schema was dropped and checked gone
}

// openPG connects to PostgreSQL and makes the run's schema and tables.
// base is the run's "amqpidem-bench-<id>"; its id names the schema.
func openPG(ctx context.Context, o options, base string) (*pgEnv, error) {
	cfg, err := pgConfig(o, base+"-admin")
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 2
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	admin, err := pgxpool.NewWithConfig(dctx, cfg)
	if err == nil {
		err = admin.Ping(dctx)
		if err != nil {
			admin.Close()
		}
	}
	if err != nil {
		return nil, &pgUnreachable{dsn: o.PGDSN, err: err}
	}
	p := &pgEnv{
		o:      o,
		admin:  admin,
		schema: strings.ReplaceAll(strings.ReplaceAll(base, "amqpidem-bench-", "amqpidem_bench_"), "-", "_"),
		conns:  int32(o.PGConns),

		sharedApp: base + "-pg",
	}
	q := func(table string) string { return pgx.Identifier{p.schema, table}.Sanitize() }
	p.records, p.effects, p.idem = q(pgRecordsTable), q(pgEffectsTable), q(pgIdemTable)
	p.effectSQL = "INSERT INTO " + p.effects + " (msg_id, queue) VALUES ($1, $2)"
	p.idemSQL = "INSERT INTO " + p.idem + " (key) VALUES ($1) ON CONFLICT DO NOTHING"

	if err := admin.QueryRow(ctx, "SHOW server_version").Scan(&p.version); err != nil {
		admin.Close()
		return nil, fmt.Errorf("PostgreSQL: %w", err)
	}
	if err := p.setup(ctx, o); err != nil {
		// Whatever part of the schema was made goes.
		return nil, errors.Join(err, p.close(context.WithoutCancel(ctx)))
	}
	return p, nil
}

// pgUnreachable is openPG's error when PostgreSQL does not answer: the
// bench then goes on without the pg variants.
type pgUnreachable struct {
	dsn string
	err error
}

func (e *pgUnreachable) Error() string {
	return fmt.Sprintf("PostgreSQL at %s does not answer: %v", redactDSN(e.dsn), e.err)
}

func (e *pgUnreachable) Unwrap() error { return e.err }

// pgConfig is a pool configuration for o.PGDSN whose sessions say app in
// pg_stat_activity.
func pgConfig(o options, app string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(o.PGDSN)
	if err != nil {
		return nil, fmt.Errorf("-pg-dsn %s: %w", redactDSN(o.PGDSN), err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	if o.PGSyncCommit != "" {
		cfg.ConnConfig.RuntimeParams["synchronous_commit"] = o.PGSyncCommit
	}
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	return cfg, nil
}

func (p *pgEnv) setup(ctx context.Context, o options) error {
	stmts := []string{
		"CREATE SCHEMA " + pgx.Identifier{p.schema}.Sanitize(),
		"CREATE TABLE " + p.effects + " (msg_id text NOT NULL, queue text NOT NULL)",
		"CREATE TABLE " + p.idem + " (key text PRIMARY KEY)",
	}
	for _, s := range stmts {
		if _, err := p.admin.Exec(ctx, s); err != nil {
			return fmt.Errorf("PostgreSQL: %s: %w", s, err)
		}
	}
	if err := pgstore.Migrate(ctx, p.admin, p.storeConfig("")); err != nil {
		return fmt.Errorf("pgstore.Migrate: %w", err)
	}
	// What the variants' sessions will run with.
	cfg, err := pgConfig(o, "amqpidem-bench-probe")
	if err != nil {
		return err
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return fmt.Errorf("PostgreSQL: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := conn.QueryRow(ctx, "SHOW synchronous_commit").Scan(&p.syncCommit); err != nil {
		return fmt.Errorf("PostgreSQL: %w", err)
	}
	var backend int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		return fmt.Errorf("PostgreSQL: %w", err)
	}
	if isLoopbackDSN(o.PGDSN) {
		p.postmaster = postmasterOf(backend)
	}
	return nil
}

// storeConfig is the pgstore configuration of a run's prefix: the records
// of different rounds are apart by their prefix, as in Redis. The
// background cleanup is off: with a retention of an hour it would find
// nothing, and the tables are emptied between rounds.
func (p *pgEnv) storeConfig(prefix string) pgstore.Config {
	return pgstore.Config{
		Config:          lock.Config{Prefix: prefix},
		Schema:          p.schema,
		Table:           pgRecordsTable,
		CleanupInterval: -1,
	}
}

// truncate empties the run's tables (between rounds: the records,
// keys and effects are no longer needed).
func (p *pgEnv) truncate(ctx context.Context) error {
	_, err := p.admin.Exec(ctx, "TRUNCATE "+p.records+", "+p.idem+", "+p.effects)
	if err != nil {
		return fmt.Errorf("PostgreSQL: truncate: %w", err)
	}
	return nil
}

// close drops the run's schema (tables, pgstore's functions) and checks it
// is gone, then closes the admin pool.
func (p *pgEnv) close(ctx context.Context) error {
	defer p.admin.Close()
	if p.shared != nil {
		p.shared.Close()
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := p.admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{p.schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("PostgreSQL: dropping schema %s: %w", p.schema, err)
	}
	var left bool
	if err := p.admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", p.schema).Scan(&left); err != nil {
		return fmt.Errorf("PostgreSQL: checking schema %s: %w", p.schema, err)
	}
	if left {
		return fmt.Errorf("PostgreSQL: schema %s still exists after DROP", p.schema)
	}
	p.dropped = true
	return nil
}

// xactCommit is pg_stat_database.xact_commit of the current database: the
// transactions committed in it by every session, as far as the sessions
// have reported them.
func (p *pgEnv) xactCommit(ctx context.Context) (int64, error) {
	var n int64
	err := p.admin.QueryRow(ctx, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").Scan(&n)
	return n, err
}

// effectRows counts the effect rows a run's handlers inserted.
func (p *pgEnv) effectRows(ctx context.Context, queue string) (int, error) {
	var n int
	err := p.admin.QueryRow(ctx, "SELECT count(*) FROM "+p.effects+" WHERE queue = $1", queue).Scan(&n)
	return n, err
}

// pgEffect is the handler effect of every PostgreSQL variant: one plain
// INSERT of a row naming the message and the run's queue.
func (p *pgEnv) pgEffect(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, d *amqp.Delivery, queue string) error {
	_, err := q.Exec(ctx, p.effectSQL, d.MessageId, queue)
	return err
}

// pgNaiveHandle is pg-naive's work: an autocommit INSERT of the key into
// idem, ON CONFLICT DO NOTHING; if a row was inserted, the effect in a
// transaction of its own. A key already there is a duplicate: acked without
// running. (Not safe: a crash between the two commits loses the effect for
// good.)
func (p *pgEnv) pgNaiveHandle(pool *pgxpool.Pool, prefix, queue string) handleFunc {
	return func(ctx context.Context, d *amqp.Delivery) error {
		tag, err := pool.Exec(ctx, p.idemSQL, prefix+d.MessageId)
		if err != nil {
			return fmt.Errorf("pg-naive INSERT idem: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return nil
		}
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.pgEffect(ctx, tx, d, queue) })
		if err != nil {
			return fmt.Errorf("pg-naive effect: %w", err)
		}
		return nil
	}
}

// pgTxFunc is pg-unique's and pg-duplicate's work, in the transaction
// TxHandler begins and commits with the record.
func (p *pgEnv) pgTxFunc(queue string) pgstore.TxFunc {
	return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return nil, p.pgEffect(ctx, tx, d, queue)
	}
}

// pgBatchFunc is pg-batch's work: each message's effect (the same
// INSERT as the other variants', one per message), sent together in one
// pgx.Batch, in the transaction BatchTxHandler commits with the batch's
// records.
func (p *pgEnv) pgBatchFunc(queue string) pgstore.BatchTxFunc {
	return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		b := &pgx.Batch{}
		for _, d := range ds {
			b.Queue(p.effectSQL, d.MessageId, queue)
		}
		return nil, tx.SendBatch(ctx, b).Close()
	}
}

// startPG starts variant v's consumer on queue with r's pool.
func (e *env) startPG(ctx context.Context, v variant, r *pgRun, queue, prefix string, t *tally) (consumer, error) {
	if v == pgNaive {
		return startPlain(ctx, e.opts.AMQPURL, queue, e.opts.Prefetch, e.opts.Concurrency,
			e.pg.pgNaiveHandle(r.pool, prefix+"-naive:", queue), t)
	}
	if v == pgBatch {
		return startIdem(ctx, r.store, idemConfig{
			url: e.opts.AMQPURL, queue: queue, queueType: "classic",
			leaseTTL: leaseTTL, retention: retention, want: amqpidem.Completed,
			batch: r.store.BatchTxHandler(e.pg.pgBatchFunc(queue)), batchSize: pgBatchSize,
		}, t)
	}
	want := amqpidem.Completed
	if v == pgDuplicate {
		want = amqpidem.Duplicate
	}
	return startIdem(ctx, r.store, idemConfig{
		url: e.opts.AMQPURL, queue: queue, queueType: "classic",
		prefetch: e.opts.Prefetch, concurrency: e.opts.Concurrency,
		leaseTTL: leaseTTL, retention: retention,
		handler: r.store.TxHandler(e.pg.pgTxFunc(queue)), want: want,
	}, t)
}

// printPGLines prints issue 26's PostgreSQL lines, last: pg-unique's
// median rate over pg-naive's, and each one's PostgreSQL CPU per message
// in µs (every server process, as in the table; left out where the
// server's processes are not readable here). None when either variant
// did not run.
func printPGLines(out io.Writer, rep *report) {
	measured := rep.Variants["classic"]
	if !slices.Contains(measured, pgUnique) || !slices.Contains(measured, pgNaive) {
		printPGBatchLines(out, rep)
		return
	}
	r := 0.0
	if n := median(rates(rep.Runs, "classic", pgNaive)); n > 0 {
		r = median(rates(rep.Runs, "classic", pgUnique)) / n
	}
	fmt.Fprintf(out, "ratio pg-unique/pg-naive classic %.2f\n", r)
	if rep.PGCPU {
		for _, v := range []variant{pgUnique, pgNaive} {
			cpu := perMessage(rep.Runs, "classic", v, func(r runResult) float64 { return float64(r.PGCPU) })
			fmt.Fprintf(out, "pg_cpu_us %s classic %.1f\n", v, cpu/1e3)
		}
	}
	printPGBatchLines(out, rep)
}

// printPGBatchLines prints issue 39's lines, when pg-batch and pg-naive
// ran: pg-batch's median rate over pg-naive's, and its transactions
// committed per message (counted client side, as the table's commits/msg:
// the batch's COMMIT and its leases' autocommit, heartbeat included), and
// the p99 latency it adds over the bare consumer beside it at each fixed
// rate (ms; the median over -latency-repeats pairs).
func printPGBatchLines(out io.Writer, rep *report) {
	measured := rep.Variants["classic"]
	if !slices.Contains(measured, pgBatch) || !slices.Contains(measured, pgNaive) {
		return
	}
	b := 0.0
	if n := median(rates(rep.Runs, "classic", pgNaive)); n > 0 {
		b = median(rates(rep.Runs, "classic", pgBatch)) / n
	}
	fmt.Fprintf(out, "ratio pg-batch/pg-naive classic %.2f\n", b)
	fmt.Fprintf(out, "commits_per_msg pg-batch %.3f\n", perMessage(rep.Runs, "classic", pgBatch, func(r runResult) float64 {
		if r.PG == nil {
			return 0
		}
		return float64(r.PG.Committed())
	}))
	var rates []float64 // pg-batch's, in the order they ran
	for _, l := range rep.Latency {
		if l.Variant == pgBatch && !slices.Contains(rates, l.Rate) {
			rates = append(rates, l.Rate)
		}
	}
	for _, rate := range rates {
		if ms, note, ok := addedP99(rep.Latency, pgBatch, "classic", rate); ok {
			fmt.Fprintf(out, "latency_p99_ms pg-batch %s classic %.1f%s\n", strconv.FormatFloat(rate, 'f', -1, 64), ms, note)
		}
	}
}

// redactDSN hides a DSN's password.
func redactDSN(dsn string) string {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return "(unparsable PostgreSQL DSN)"
	}
	return fmt.Sprintf("postgres://%s@%s/%s", cfg.User, net.JoinHostPort(cfg.Host, fmt.Sprint(cfg.Port)), cfg.Database)
}

// isLoopbackDSN says whether dsn's host is a loopback address or a Unix
// socket: only then is the server's process readable in this machine's
// /proc.
func isLoopbackDSN(dsn string) bool {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return false
	}
	if strings.HasPrefix(cfg.Host, "/") || cfg.Host == "localhost" {
		return true
	}
	ip := net.ParseIP(cfg.Host)
	return ip != nil && ip.IsLoopback()
}
