package linearizable_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// localClock is the Params of a store on this host whose leases run by
// its server's clock in milliseconds: the server's rounding down
// (DeadlineSlack) and a millisecond either way between its wall clock and
// the recorder's monotonic one.
var localClock = linearizable.Params{Early: lock.DeadlineSlack + 2*time.Millisecond, Late: 2 * time.Millisecond}

// faults runs fault, then waits a random pause up to every, until run's
// clients are done, at most max times. It runs on the test's goroutine
// (testenv.Server.Start must).
func faults(run *linearizable.Run, max int, every time.Duration, fault func()) int {
	n := 0
	for ; n < max; n++ {
		select {
		case <-run.Done():
			return n
		case <-time.After(every/2 + rand.N(every/2)):
		}
		fault()
	}
	return n
}

// redisStore starts a redis-server of the test's own with AOF fsynced on
// every write and returns it with a store on it.
func redisStore(t *testing.T) (*testenv.Server, *lock.RedisStore) {
	srv := testenv.RedisServer(t, "--appendonly", "yes", "--appendfsync", "always")
	return srv, redisStoreAt(t, srv.Addr)
}

// redisStoreAt returns a store on the Redis at addr, with the timeouts
// of the runs under faults.
func redisStoreAt(t *testing.T, addr string) *lock.RedisStore {
	client := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true,
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, WriteTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	s, err := lock.NewRedisStore(client, lock.Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// faultWorkload sizes a run against a real store: under faults, calls
// time out after 300 ms, so that a pause or an outage makes answers
// ambiguous rather than late.
func faultWorkload() linearizable.Workload {
	return size(
		linearizable.Workload{Clients: 4, Keys: 8, Ops: 3000, Duration: 5 * time.Second, TTL: 50 * time.Millisecond, Timeout: 300 * time.Millisecond, Seed: seed()},
		linearizable.Workload{Clients: 8, Keys: 16, Ops: 20000, Duration: 60 * time.Second, TTL: 50 * time.Millisecond, Timeout: 300 * time.Millisecond, Seed: seed()},
	)
}

func TestRedis(t *testing.T) {
	t.Run("none", func(t *testing.T) {
		_, s := redisStore(t)
		w := faultWorkload()
		run := linearizable.Start(s, w)
		wantOK(t, check(t, "redis-none", localClock, w, run.History()))
	})
	t.Run("kill9", func(t *testing.T) {
		srv, s := redisStore(t)
		w := faultWorkload()
		run := linearizable.Start(s, w)
		n := faults(run, 20, time.Second, func() {
			srv.Stop() // SIGKILL
			time.Sleep(time.Duration(100+rand.IntN(500)) * time.Millisecond)
			srv.Start() // loads the AOF
		})
		res := check(t, "redis-kill9", localClock, w, run.History())
		t.Logf("redis-kill9: %d kills, %d ambiguous operations", n, res.Ambiguous)
		wantOK(t, res)
	})
	t.Run("sigstop", func(t *testing.T) {
		srv, s := redisStore(t)
		w := faultWorkload()
		run := linearizable.Start(s, w)
		n := faults(run, 20, time.Second, func() {
			srv.Pause() // SIGSTOP
			time.Sleep(time.Duration(200+rand.IntN(600)) * time.Millisecond)
			srv.Resume()
		})
		res := check(t, "redis-sigstop", localClock, w, run.History())
		t.Logf("redis-sigstop: %d pauses, %d ambiguous operations", n, res.Ambiguous)
		wantOK(t, res)
	})
}

// TestPostgres runs against the shared PostgreSQL, in a schema of its own,
// on a pool whose connections carry an application_name of their own:
// the fault terminates those backends, and no others.
func TestPostgres(t *testing.T) {
	app := testenv.Name(t)
	cfg, err := pgxpool.ParseConfig(pgenv.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	admin := pgenv.Pool(t, 2) // another application_name: never terminated
	pcfg := pgstore.Config{Schema: strings.ToLower(app), CleanupInterval: -1}
	if err := pgstore.Migrate(ctx, admin, pcfg); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{pcfg.Schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema: %v", err)
		}
	})
	store := func(t *testing.T) *pgstore.Store {
		c := pcfg
		c.Prefix = testenv.Name(t)
		c.Logger = slog.New(slog.DiscardHandler) // the guard's warnings of abandoned held leases
		s, err := pgstore.New(pool, c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		return s
	}
	w := faultWorkload()
	// Acquire answers InProgress on a key a concurrent Acquire holds the
	// advisory lock of, whatever the record (see Params.Busy).
	p := localClock
	p.Busy = true
	terminate := func(t *testing.T) int {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var k int
		err := admin.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
			FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()`, app).Scan(&k)
		if err != nil {
			t.Errorf("pg_terminate_backend: %v", err)
		}
		return k
	}
	// First, while the pool has no connection a fault ended.
	t.Run("held-late-write", func(t *testing.T) { heldLateWrite(t, store(t), p) })
	// The record-row leases of Acquire, and those TxHandler takes
	// (heldStore): held by a transaction, or a record row.
	for _, lease := range []string{"", "held-"} {
		s := func(t *testing.T) linearizable.Store {
			if lease == "" {
				return store(t)
			}
			return newHeldStore(store(t))
		}
		p, w := p, w
		if lease != "" {
			// Held leases' late writes are not linearizable
			// (TestPostgresHeldLateWrite): left out here, with
			// leases long enough that a holder's writes come well
			// within them.
			p.Held = heldOwner
			w.NoLateWrites, w.TTL = true, 100*time.Millisecond
		}
		t.Run(lease+"none", func(t *testing.T) {
			run := linearizable.Start(s(t), w)
			res := check(t, "pgstore-"+lease+"none", p, w, run.History())
			if lease != "" {
				wantHeld(t, res.Name, run.History())
			}
			wantOK(t, res)
		})
		t.Run(lease+"terminate", func(t *testing.T) {
			run := linearizable.Start(s(t), w)
			killed := 0
			n := faults(run, 30, 500*time.Millisecond, func() { killed += terminate(t) })
			history := run.History()
			p := p
			p.SessionsEnd = true
			res := check(t, "pgstore-"+lease+"terminate", p, w, history)
			t.Logf("%s: %d rounds, %d backends terminated, %d ambiguous operations", res.Name, n, killed, res.Ambiguous)
			if lease != "" {
				wantHeld(t, res.Name, history)
			}
			wantOK(t, res)
		})
	}
}

// TestDynamo runs against minidyn and DynamoDB Local (testenv.EachDynamo)
// with call timeouts short enough (4 ms, or twice the server's median
// Acquire time under 4 clients when that is longer) that some calls time out after
// DynamoDB applied them, or before. On a loaded machine DynamoDB Local
// answers most calls in more than 4 ms: with nearly every call ambiguous,
// the check ran out of its budget (result=unknown) in two clean-clone CI
// runs, which is why the timeout follows the server's pace.
func TestDynamo(t *testing.T) {
	testenv.EachDynamo(t, func(t *testing.T, srv testenv.DynamoServer) {
		dynamoRuns(t, srv.Name, srv.Endpoint)
	})
}

// dynamoRuns runs the none and timeouts runs against the DynamoDB at
// endpoint, named server in the lines printed.
func dynamoRuns(t *testing.T, server, endpoint string) {
	client := dynamodb.New(dynamodb.Options{
		Region:       testenv.DynamoRegion,
		BaseEndpoint: aws.String(endpoint),
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: testenv.DynamoAccessKeyID, SecretAccessKey: testenv.DynamoSecretAccessKey, Source: "tests"}, nil
		}),
	})
	table := testenv.Name(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := dynamostore.CreateTable(ctx, client, dynamostore.Config{Table: table}); err != nil {
		t.Fatalf("CreateTable: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = client.DeleteTable(ctx, &dynamodb.DeleteTableInput{TableName: aws.String(table)})
	})
	const skew = 5 * time.Millisecond
	// Leases run by the clients' clock (the recorder's process), plus the
	// skew the store allows before a takeover.
	p := linearizable.Params{Early: lock.DeadlineSlack + time.Millisecond, Late: skew + 2*time.Millisecond}
	for _, tc := range []struct {
		fault   string
		timeout time.Duration
	}{{"none", time.Second}, {"timeouts", 4 * time.Millisecond}} {
		t.Run(tc.fault, func(t *testing.T) {
			s, err := dynamostore.New(client, dynamostore.Config{Config: lock.Config{Prefix: testenv.Name(t)}, Table: table, MaxClockSkew: skew})
			if err != nil {
				t.Fatal(err)
			}
			timeout := tc.timeout
			if tc.fault == "timeouts" {
				median := acquireMedian(t, client, table)
				timeout = max(timeout, 2*median)
				t.Logf("median Acquire %v: call timeout %v", median, timeout)
			}
			w := size(
				linearizable.Workload{Clients: 4, Keys: 8, Ops: 1500, Duration: 8 * time.Second, TTL: 50 * time.Millisecond, Timeout: timeout, Seed: seed()},
				linearizable.Workload{Clients: 8, Keys: 16, Ops: 10000, Duration: 60 * time.Second, TTL: 50 * time.Millisecond, Timeout: timeout, Seed: seed()},
			)
			run := linearizable.Start(s, w)
			res := check(t, fmt.Sprintf("dynamostore-%s-%s", server, tc.fault), p, w, run.History())
			t.Logf("%s: %d ambiguous operations", res.Name, res.Ambiguous)
			if tc.fault == "timeouts" && res.Ambiguous == 0 {
				t.Errorf("%s: no call timed out: the fault did not happen (a faster server? lower the timeout)", res.Name)
			}
			wantOK(t, res)
		})
	}
}

// acquireMedian is the median time of Acquires of new keys on table, by
// a store of a namespace of its own, made by as many clients at once as
// the workload's (4), 6 each: the pace the workload's calls will see.
func acquireMedian(t *testing.T, client *dynamodb.Client, table string) time.Duration {
	t.Helper()
	s, err := dynamostore.New(client, dynamostore.Config{Config: lock.Config{Prefix: testenv.Name(t) + "-pace"}, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	const clients, each = 4, 6
	ds := make([]time.Duration, clients*each)
	errs := make([]error, clients)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				t0 := time.Now()
				if _, err := s.Acquire(context.Background(), lock.Request{Key: fmt.Sprintf("pace-%d-%d", c, i)}); err != nil {
					errs[c] = err
					return
				}
				ds[c*each+i] = time.Since(t0)
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("Acquire: %v", err)
		}
	}
	slices.Sort(ds)
	return ds[len(ds)/2]
}
