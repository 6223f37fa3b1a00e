// Package worker is the chaos suite's consumer: an amqpidem.Consumer whose
// handler follows the plan carried by each message (workload.Plan), writes
// its side effect to the run's ledger with the lease's fencing token, logs
// every execution there, and can kill its own process in a chosen crash
// window. cmd/consumer runs it as a process; scenarios that neither kill nor
// pause consumers may run it in the test process.
//
// With Config.StoreDSN the worker keeps its records in PostgreSQL
// (pgstore) instead of Redis, and its handler writes a non-idempotent
// effect in pgstore's transaction (see pg.go). With Config.StageTo it is
// stage A of a two-stage pipeline: its handler stages a message for stage
// B (amqpidem.Stage) instead of writing the ledger (see stage.go).
package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// Defaults of Config.
const (
	// DefaultHeartbeat is the AMQP heartbeat interval.
	DefaultHeartbeat = 10 * time.Second
	// DefaultRedisTimeout bounds each Redis dial, read and write.
	DefaultRedisTimeout = time.Second
	// ledgerTimeout bounds each ledger call.
	ledgerTimeout = 30 * time.Second
)

// Config configures a Worker. Zero values mean the library's defaults
// unless stated otherwise.
type Config struct {
	// Name is the consumer's name: its AMQP connection_name (so that a
	// test can close exactly its connections), its ConsumerName and the
	// prefix of its execution ids. Required.
	Name string
	// AMQPURL, RedisAddr, PGDSN are where the broker, the store and the
	// ledger are; Schema is the ledger's schema. Required. AMQPURL may list
	// several nodes of a cluster, separated by commas: every dial tries
	// them in that order and takes the first that answers.
	AMQPURL, RedisAddr, PGDSN, Schema string
	// Queue is the queue consumed and Prefix the store's key prefix.
	// Required.
	Queue, Prefix string
	// EventsPath is a file to which every Observer event is appended as a
	// JSON line (see EventRecord). Empty: none.
	EventsPath string
	// HistoryPath, when set, is a new file to which every call of the
	// consumer on its store, and every return, is written as it happens
	// (linearizable.NewFileRecorder, wall-clock times): Acquire, Extend,
	// Complete, Fail, Release, Cancel and Amend, with a transactional
	// handler's AcquireLease and HandleComplete as the Acquire and
	// Complete they are. A test merges the files of a run's processes
	// (linearizable.ReadHistories) and checks the history. Empty: none.
	HistoryPath string

	// LeaseTTL, Retention, InProgressDelay, UnavailableDelay and
	// MaxAttempts are amqpidem.Config's.
	LeaseTTL, Retention, InProgressDelay, UnavailableDelay time.Duration
	MaxAttempts                                            int
	// StoreLeaseTTL is lock.Config.LeaseTTL.
	StoreLeaseTTL time.Duration
	// Backoff is the first retry delay; later ones double, up to 2 s,
	// without jitter. Zero: the library's default backoff.
	Backoff time.Duration
	// Prefetch and Concurrency are amqpidem.ConsumerConfig's.
	Prefetch, Concurrency int
	// QueueArgs declare the queue (quorum, delivery limit).
	QueueArgs amqp.Table
	// KeyHeader reads the idempotency key from this header
	// (amqpidem.Header) instead of the message-id.
	KeyHeader string
	// DeadLetterExchange and DeadLetterRoutingKey are amqpidem.Config's.
	DeadLetterExchange, DeadLetterRoutingKey string
	// DeadLetterQueueArgs are amqpidem.Config's (a quorum dead-letter
	// queue on a cluster).
	DeadLetterQueueArgs amqp.Table
	// DelayInProcess is amqpidem.Config's.
	DelayInProcess bool
	// AckFailedDuplicates selects amqpidem.AckFailedDuplicate.
	AckFailedDuplicates bool
	// SigningKey is amqpidem.Config's: the copies the consumer publishes
	// are signed with it.
	SigningKey []byte
	// Fixed makes plans marked Broken succeed: the handler after the
	// deploy that fixed their failure.
	Fixed bool

	// Heartbeat is the AMQP heartbeat. Default DefaultHeartbeat.
	Heartbeat time.Duration
	// RedisTimeout bounds Redis dials, reads and writes. Default
	// DefaultRedisTimeout.
	RedisTimeout time.Duration
	// SentinelAddrs and MasterName, when set, reach Redis through these
	// Sentinels (a failover client) instead of RedisAddr.
	SentinelAddrs []string
	MasterName    string
	// Replicas is lock.Config.Replicas, with ReplicaTimeout a third of
	// RedisTimeout.
	Replicas int
	// AllowCrash lets crash windows kill the process. When false (a worker
	// in a test process) they are ignored.
	AllowCrash bool
	// Logger receives the library's logs. Nil discards.
	Logger *slog.Logger

	// StoreDSN, when set, selects the PostgreSQL store (pgstore) at this
	// DSN instead of Redis (RedisAddr is then unused): the records live in
	// Schema there, next to the effects table EffectsTable, which the
	// handler fills in pgstore's transaction (pg.go). Migrate must have
	// run and the effects table must exist.
	StoreDSN string
	// StoreAppName is the application_name of the store's connections, so
	// that a test can find (and terminate) exactly them. Default Name +
	// "-store".
	StoreAppName string
	// RowLeases is pgstore.Config.RowLeases: every lease a record row,
	// none held by the handler's transaction.
	RowLeases bool

	// DynamoEndpoint, when set, selects the DynamoDB store (dynamostore)
	// on the DynamoDB-compatible server at this endpoint instead of Redis
	// (RedisAddr is then unused): the records live in DynamoTable
	// (dynamostore.CreateTable must have made it), and the handler puts
	// one item per execution in DynamoEffects in dynamostore's
	// transaction (dynamo.go).
	DynamoEndpoint, DynamoTable, DynamoEffects string

	// StageTo, when set, makes the worker stage A of a two-stage pipeline
	// (stage.go): its handler does the plan's work and stages one message
	// per execution (amqpidem.Stage) to exchange StageExchange (empty: the
	// default exchange) with routing key StageTo, instead of writing the
	// ledger. Stage B is a worker consuming those messages: it writes the
	// ledger, keyed by the operation the message's plan names.
	StageTo, StageExchange string
}

// Worker is one chaos consumer. Run it once; Shutdown stops it and closes
// its connections. It is safe for concurrent use.
type Worker struct {
	cfg      Config
	pid      int
	rdb      *redis.Client
	led      *ledger.Ledger
	events   *eventLog
	consumer *amqpidem.Consumer
	seq      atomic.Int64
	// history records the store's calls (Config.HistoryPath); nil: none.
	history     *linearizable.Recorder
	rec         *linearizable.Client // history's client, the process's
	historyOnce sync.Once

	// leases holds, per lease, what the store wrapper and the handler
	// share. Entries are removed on Complete (a stage A worker's on the
	// Amend that records its staged message published), Fail and Release;
	// those of leases lost before then stay until the process ends (a
	// chaos consumer lives for minutes).
	mu     sync.Mutex
	leases map[leaseID]*leaseInfo

	// pg mode (Config.StoreDSN): the store and its pool.
	pgStore *pgstore.Store
	pgPool  *pgxpool.Pool
}

type leaseID struct {
	key   string
	fence int64
}

// leaseInfo is what the store wrapper and the handler share about one
// lease.
type leaseInfo struct {
	acquired time.Time
	plan     planRef
}

type planRef struct {
	crash  string
	stop   string // a window where the process stops itself
	op     string
	execID string
	// inserted: pg mode: the handler inserted its effect in the
	// transaction (committed or not).
	inserted bool
}

// New connects to the ledger and the store (checking it) and prepares the
// consumer; it does not consume until Run.
func New(ctx context.Context, cfg Config) (*Worker, error) {
	switch {
	case cfg.Name == "":
		return nil, errors.New("worker: Config.Name is required")
	case cfg.AMQPURL == "" || (cfg.RedisAddr == "" && cfg.StoreDSN == "" && cfg.DynamoEndpoint == "") || cfg.PGDSN == "" || cfg.Schema == "":
		return nil, errors.New("worker: Config.AMQPURL, RedisAddr (or StoreDSN or DynamoEndpoint), PGDSN and Schema are required")
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.RedisTimeout == 0 {
		cfg.RedisTimeout = DefaultRedisTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	w := &Worker{cfg: cfg, pid: os.Getpid(), leases: map[leaseID]*leaseInfo{}}
	ok := false
	var closers []func()
	defer func() {
		if !ok {
			for i := len(closers) - 1; i >= 0; i-- {
				closers[i]()
			}
		}
	}()

	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var err error
	w.led, err = ledger.Open(cctx, cfg.PGDSN, cfg.Schema, min(max(cfg.Concurrency, 4), 8))
	if err != nil {
		return nil, err
	}
	closers = append(closers, w.led.Close)
	if cfg.EventsPath != "" {
		w.events, err = openEventLog(cfg.EventsPath, cfg.Name, w.pid)
		if err != nil {
			return nil, err
		}
		closers = append(closers, func() { _ = w.events.close() })
	}

	acfg := amqpidem.Config{
		Queue:                cfg.Queue,
		LeaseTTL:             cfg.LeaseTTL,
		Retention:            cfg.Retention,
		MaxAttempts:          cfg.MaxAttempts,
		InProgressDelay:      cfg.InProgressDelay,
		UnavailableDelay:     cfg.UnavailableDelay,
		DeadLetterExchange:   cfg.DeadLetterExchange,
		DeadLetterRoutingKey: cfg.DeadLetterRoutingKey,
		DeadLetterQueueArgs:  cfg.DeadLetterQueueArgs,
		DelayInProcess:       cfg.DelayInProcess,
		SigningKey:           cfg.SigningKey,
		ConsumerName:         cfg.Name,
		Logger:               cfg.Logger,
	}
	if w.events != nil {
		acfg.Observer = w.events
	}
	if cfg.KeyHeader != "" {
		acfg.Key = amqpidem.Header(cfg.KeyHeader)
	}
	if cfg.AckFailedDuplicates {
		acfg.FailedDuplicate = amqpidem.AckFailedDuplicate
	}
	if cfg.Backoff > 0 {
		first := cfg.Backoff
		acfg.Backoff = func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval = first
			b.Multiplier = 2
			b.RandomizationFactor = 0
			b.MaxInterval = 2 * time.Second
			b.MaxElapsedTime = 0
			b.Reset()
			return b
		}
	}

	var (
		st      lock.Store
		handler amqpidem.Handler
		check   func(context.Context) error
	)
	if cfg.StoreDSN != "" {
		s, h, closePG, err := w.openPG(cctx)
		if err != nil {
			return nil, err
		}
		closers = append(closers, closePG)
		st, handler, check = s, h, w.pgStore.Check
	} else if cfg.DynamoEndpoint != "" {
		s, h, ds, err := w.openDynamo()
		if err != nil {
			return nil, err
		}
		st, handler, check = s, h, ds.Check
	} else {
		if len(cfg.SentinelAddrs) > 0 {
			w.rdb = redis.NewFailoverClient(&redis.FailoverOptions{
				MasterName:            cfg.MasterName,
				SentinelAddrs:         cfg.SentinelAddrs,
				DialTimeout:           cfg.RedisTimeout,
				ReadTimeout:           cfg.RedisTimeout,
				WriteTimeout:          cfg.RedisTimeout,
				ContextTimeoutEnabled: true,
			})
		} else {
			w.rdb = redis.NewClient(&redis.Options{
				Addr:                  cfg.RedisAddr,
				DialTimeout:           cfg.RedisTimeout,
				ReadTimeout:           cfg.RedisTimeout,
				WriteTimeout:          cfg.RedisTimeout,
				ContextTimeoutEnabled: true,
			})
		}
		closers = append(closers, func() { _ = w.rdb.Close() })
		rs, err := lock.NewRedisStore(w.rdb, lock.Config{
			Prefix:         cfg.Prefix,
			LeaseTTL:       cfg.StoreLeaseTTL,
			Logger:         cfg.Logger,
			Replicas:       cfg.Replicas,
			ReplicaTimeout: cfg.RedisTimeout / 3,
		})
		if err != nil {
			return nil, err
		}
		handler = amqpidem.HandlerFunc(w.handle)
		if cfg.StageTo != "" {
			handler = amqpidem.HandlerFunc(w.handleStage)
		}
		rec, err := w.recorded(rs)
		if err != nil {
			return nil, err
		}
		st, check = &store{Store: rec, w: w}, rs.Check
	}

	closers = append(closers, func() { _ = w.closeHistory() })

	hb := cfg.Heartbeat
	w.consumer, err = amqpidem.NewConsumer(st, amqpidem.ConsumerConfig{
		Config:      acfg,
		Prefetch:    cfg.Prefetch,
		Concurrency: cfg.Concurrency,
		QueueArgs:   cfg.QueueArgs,
		Dial: func() (*amqp.Connection, error) {
			// The nodes in order: the first is this consumer's own, the
			// others stand in while it is down.
			var errs []error
			for _, url := range strings.Split(cfg.AMQPURL, ",") {
				conn, err := amqp.DialConfig(url, amqp.Config{
					Heartbeat:  hb,
					Properties: amqp.Table{"connection_name": cfg.Name},
					Dial:       amqp.DefaultDial(5 * time.Second),
				})
				if err == nil {
					return conn, nil
				}
				errs = append(errs, err)
			}
			return nil, errors.Join(errs...)
		},
		Reconnect: func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval = 100 * time.Millisecond
			b.MaxInterval = time.Second
			b.MaxElapsedTime = 0
			b.Reset()
			return b
		},
	}, handler)
	if err != nil {
		return nil, err
	}
	closers = append(closers, func() { _ = w.consumer.Shutdown(context.Background()) })

	if err := check(cctx); err != nil {
		return nil, err
	}
	ok = true
	return w, nil
}

// Run consumes until Shutdown or ctx ends; see amqpidem.Consumer.Run.
func (w *Worker) Run(ctx context.Context) error { return w.consumer.Run(ctx) }

// Shutdown stops consuming (amqpidem.Consumer.Shutdown) and closes the
// ledger, the store's client and the event log.
func (w *Worker) Shutdown(ctx context.Context) error {
	err := w.consumer.Shutdown(ctx)
	w.led.Close()
	if w.rdb != nil {
		w.rdb.Close()
	}
	if w.pgStore != nil {
		w.pgStore.Close()
		w.pgPool.Close()
	}
	if w.events != nil {
		err = errors.Join(err, w.events.close())
	}
	return errors.Join(err, w.closeHistory())
}

// recorded returns s, or, with Config.HistoryPath, s recorded there: the
// process's client of a file recorder on s.
func (w *Worker) recorded(s linearizable.Store) (lock.Store, error) {
	if w.cfg.HistoryPath == "" {
		return s, nil
	}
	r, err := linearizable.NewFileRecorder(s, w.cfg.HistoryPath)
	if err != nil {
		return nil, fmt.Errorf("worker: history: %w", err)
	}
	w.history, w.rec = r, r.Client(0)
	return w.rec, nil
}

// closeHistory closes the history's file, if there is one, once.
func (w *Worker) closeHistory() error {
	if w.history == nil {
		return nil
	}
	var err error
	w.historyOnce.Do(func() { err = w.history.Close() })
	return err
}

// ledgerCtx bounds one ledger call, whatever the handler's context: the
// ledger is written even by a handler that was cancelled (it must log that).
func ledgerCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), ledgerTimeout)
}

// staging reports whether the worker is stage A of a pipeline
// (Config.StageTo).
func (w *Worker) staging() bool { return w.cfg.StageTo != "" }

// track remembers when the Acquire that granted (key, fence) was sent.
func (w *Worker) track(key string, fence int64, at time.Time) {
	w.mu.Lock()
	w.leases[leaseID{key, fence}] = &leaseInfo{acquired: at}
	w.mu.Unlock()
}

// attach gives the handler's plan to the lease's entry and returns when
// its Acquire was sent (zero if unknown).
func (w *Worker) attach(key string, fence int64, p planRef) time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	li := w.leases[leaseID{key, fence}]
	if li == nil {
		li = &leaseInfo{}
		w.leases[leaseID{key, fence}] = li
	}
	li.plan = p
	return li.acquired
}

// lookup returns the lease's plan.
func (w *Worker) lookup(key string, fence int64) planRef {
	w.mu.Lock()
	defer w.mu.Unlock()
	if li := w.leases[leaseID{key, fence}]; li != nil {
		return li.plan
	}
	return planRef{}
}

// untrack forgets a lease.
func (w *Worker) untrack(key string, fence int64) {
	w.mu.Lock()
	delete(w.leases, leaseID{key, fence})
	w.mu.Unlock()
}

// crash kills the process, once per operation and window (claimed in the
// ledger so that a restarted consumer does not crash on the redelivery).
func (w *Worker) crash(op, window, execID string, fence int64) {
	if !w.cfg.AllowCrash {
		return
	}
	ctx, cancel := ledgerCtx()
	defer cancel()
	first, err := w.led.ClaimCrash(ctx, op, window, execID, fence, w.pid)
	if err != nil {
		w.cfg.Logger.Error("chaos: cannot claim crash window", "op", op, "window", window, "error", err)
		return
	}
	if !first {
		return
	}
	fmt.Fprintf(os.Stderr, "chaos: %s crashing (SIGKILL) in window %s of %s, fence %d\n", w.cfg.Name, window, op, fence)
	p, err := os.FindProcess(w.pid)
	if err == nil {
		err = p.Kill()
	}
	if err != nil {
		os.Exit(137)
	}
	select {} // the signal is on its way
}

// stopSelf stops the process (SIGSTOP), once per operation and window
// (claimed in the ledger as "stop-<window>"), for the test to continue it
// (SIGCONT) when it chooses; it returns once the process was continued.
func (w *Worker) stopSelf(op, window, execID string, fence int64) {
	if !w.cfg.AllowCrash {
		return
	}
	ctx, cancel := ledgerCtx()
	defer cancel()
	first, err := w.led.ClaimCrash(ctx, op, StopWindow(window), execID, fence, w.pid)
	if err != nil {
		w.cfg.Logger.Error("chaos: cannot claim stop window", "op", op, "window", window, "error", err)
		return
	}
	if !first {
		return
	}
	fmt.Fprintf(os.Stderr, "chaos: %s stopping (SIGSTOP) in window %s of %s, fence %d\n", w.cfg.Name, window, op, fence)
	if err := syscall.Kill(w.pid, syscall.SIGSTOP); err != nil {
		w.cfg.Logger.Error("chaos: cannot stop", "op", op, "window", window, "error", err)
		return
	}
	// The signal stops every thread, this one maybe a moment after the
	// call returned: nothing of the window's next step before that.
	time.Sleep(100 * time.Millisecond)
}

// StopWindow is the name under which the ledger's crashes table claims a
// stop in window (Worker.stopSelf).
func StopWindow(window string) string { return "stop-" + window }

// messageKey is the message key of a record key made by amqpidem.StoreKey
// (the endpoint, a NUL byte, the key): the ledger and the handler know
// operations by message key.
func messageKey(storeKey string) string {
	if _, key, ok := strings.Cut(storeKey, "\x00"); ok {
		return key
	}
	return storeKey
}
