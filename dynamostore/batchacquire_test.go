package dynamostore_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// roundTrips counts the HTTP requests a DynamoDB client sends, by
// operation (the X-Amz-Target header): every SDK attempt, retries
// included.
type roundTrips struct {
	mu  sync.Mutex
	ops map[string]int
}

func (rt *roundTrips) RoundTrip(r *http.Request) (*http.Response, error) {
	op := r.Header.Get("X-Amz-Target")
	op = op[strings.LastIndex(op, ".")+1:]
	rt.mu.Lock()
	rt.ops[op]++
	rt.mu.Unlock()
	return http.DefaultTransport.RoundTrip(r)
}

// take returns the counts since the last take, as "Op=n" sorted by op,
// and the total.
func (rt *roundTrips) take() (string, int) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	var parts []string
	total := 0
	for _, op := range []string{"GetItem", "UpdateItem", "TransactWriteItems", "BatchGetItem"} {
		if n := rt.ops[op]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", op, n))
			total += n
		}
	}
	rt.ops = map[string]int{}
	return strings.Join(parts, " "), total
}

// countedStore returns a store on the shared table whose client counts
// its round trips.
func countedStore(t *testing.T, srv *server) (*dynamostore.Store, *roundTrips) {
	t.Helper()
	_, table := srv.sharedTable(t)
	rt := &roundTrips{ops: map[string]int{}}
	client := dynamodb.New(dynamodb.Options{
		Region:       testenv.DynamoRegion,
		BaseEndpoint: aws.String(srv.Endpoint),
		HTTPClient:   &http.Client{Transport: rt},
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: testenv.DynamoAccessKeyID, SecretAccessKey: testenv.DynamoSecretAccessKey, Source: "tests"}, nil
		}),
	})
	s, err := dynamostore.New(client, dynamostore.Config{Table: table, MaxClockSkew: testSkew, Config: lock.Config{Prefix: testenv.Name(t), LeaseTTL: 5 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	return s, rt
}

// TestAcquireBatchRoundTrips counts the requests AcquireBatch sends for a
// batch of 100 keys, beside Acquire one key at a time: one transaction for
// 100 new keys, one for 100 keys decided by their records, two for a
// batch mixing new keys, duplicates, keys in progress and takeovers.
func TestAcquireBatchRoundTrips(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s, rt := countedStore(t, srv)
		ctx := context.Background()
		batch := func(prefix string, n int) []lock.Request {
			reqs := make([]lock.Request, n)
			for i := range reqs {
				reqs[i] = lock.Request{Key: fmt.Sprintf("%s-%03d", prefix, i)}
			}
			return reqs
		}
		acquireAll := func(what string, reqs []lock.Request, want lock.Status) []lock.Result {
			t.Helper()
			rs, errs := s.AcquireBatch(ctx, reqs)
			for i := range reqs {
				if errs[i] != nil || rs[i].Status != want {
					t.Fatalf("%s: %q: %v, %v; want %v", what, reqs[i].Key, rs[i].Status, errs[i], want)
				}
			}
			return rs
		}
		// minidyn's cancelled transactions report the first failed
		// condition only (DynamoDB, and DynamoDB Local, report every
		// item's), so that it decides one key per transaction, and takes
		// the rest one by one: there, only batches with no failed
		// condition have their exact count, the others at most 3
		// transactions and a request per key more than Acquire's.
		check := func(what, want string, mayFail bool) {
			t.Helper()
			got, n := rt.take()
			t.Logf("%s: %d round trips (%s)", what, n, got)
			if mayFail && !srv.Strict {
				if n > 120+3 {
					t.Errorf("%s: got %s, want at most 123", what, got)
				}
				return
			}
			if got != want {
				t.Errorf("%s: got %s, want %s", what, got, want)
			}
		}

		// One by one, for comparison.
		for _, r := range batch("single", 100) {
			if res, err := s.Acquire(ctx, r); err != nil || res.Status != lock.Acquired {
				t.Fatalf("Acquire %q: %v, %v", r.Key, res.Status, err)
			}
		}
		check("Acquire of 100 new keys", "UpdateItem=100", false)

		rs := acquireAll("100 new keys", batch("new", 100), lock.Acquired)
		check("AcquireBatch of 100 new keys", "TransactWriteItems=1", false)
		acquireAll("100 keys in progress", batch("new", 100), lock.InProgress)
		check("AcquireBatch of 100 keys in progress", "TransactWriteItems=1", true)

		// 40 completed (duplicates), 20 released (taken over), 10 still
		// held, 30 new.
		for i, r := range rs[:60] {
			var err error
			if i < 40 {
				err = s.Complete(ctx, r.Lease, []byte("done"))
			} else {
				err = s.Release(ctx, r.Lease)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		rt.take()
		mixed := append(batch("new", 70), batch("more", 30)...)
		got, errs := s.AcquireBatch(ctx, mixed)
		for i := range mixed {
			want := lock.Acquired
			switch {
			case i < 40:
				want = lock.Completed
			case i >= 60 && i < 70:
				want = lock.InProgress
			}
			if errs[i] != nil || got[i].Status != want {
				t.Fatalf("mixed batch: %q: %v, %v; want %v", mixed[i].Key, got[i].Status, errs[i], want)
			}
			if i >= 40 && i < 60 && (got[i].Lease.Attempt != 2 || got[i].Lease.Fence <= rs[i].Lease.Fence) {
				t.Fatalf("takeover of %q: %+v, want attempt 2 and a fence above %d", mixed[i].Key, got[i].Lease, rs[i].Lease.Fence)
			}
		}
		check("AcquireBatch of 40 duplicates, 20 takeovers, 10 in progress, 30 new", "TransactWriteItems=2", true)
	})
}

// TestAcquireBatchConcurrentOneWinner runs four AcquireBatch calls on the
// same 50 keys at once (in different orders): every key is leased to
// exactly one of them, and every other call answers it InProgress with
// the winner's fence.
func TestAcquireBatchConcurrentOneWinner(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{Config: lock.Config{LeaseTTL: 5 * time.Second}})
		const calls, keys = 4, 50
		rs := make([][]lock.Result, calls)
		errs := make([][]error, calls)
		var wg sync.WaitGroup
		for c := range calls {
			reqs := make([]lock.Request, keys)
			for i := range reqs {
				k := i
				if c%2 == 1 {
					k = keys - 1 - i
				}
				reqs[i] = lock.Request{Key: fmt.Sprint("k", k)}
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				got, e := s.AcquireBatch(context.Background(), reqs)
				rs[c], errs[c] = make([]lock.Result, keys), make([]error, keys)
				for i := range reqs { // by key
					k := i
					if c%2 == 1 {
						k = keys - 1 - i
					}
					rs[c][k], errs[c][k] = got[i], e[i]
				}
			}()
		}
		wg.Wait()
		for k := range keys {
			var winner *lock.Result
			for c := range calls {
				if errs[c][k] != nil {
					t.Fatalf("call %d key k%d: %v", c, k, errs[c][k])
				}
				if rs[c][k].Status == lock.Acquired {
					if winner != nil {
						t.Fatalf("key k%d leased twice: fences %d and %d", k, winner.Fence, rs[c][k].Fence)
					}
					winner = &rs[c][k]
				}
			}
			if winner == nil {
				t.Fatalf("key k%d: no call got its lease", k)
			}
			for c := range calls {
				if r := rs[c][k]; r.Status != lock.Acquired && (r.Status != lock.InProgress || r.Fence != winner.Fence) {
					t.Fatalf("key k%d call %d: %v fence %d, want InProgress fence %d", k, c, r.Status, r.Fence, winner.Fence)
				}
			}
		}
	})
}

// TestAcquireBatchAnswerLost: a batch's transaction that committed but
// whose answer was lost is resent key by key with the same owners, which
// find their own leases: every key is Acquired, its first attempt, and
// the leases are the ones the store holds (Complete succeeds).
func TestAcquireBatchAnswerLost(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		client, table := srv.sharedTable(t)
		s, err := dynamostore.New(&answerLost{client}, dynamostore.Config{Table: table, Config: lock.Config{Prefix: testenv.Name(t)}})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		reqs := []lock.Request{{Key: "a"}, {Key: "b"}, {Key: "c"}}
		rs, errs := s.AcquireBatch(ctx, reqs)
		for i := range reqs {
			if errs[i] != nil || rs[i].Status != lock.Acquired || rs[i].Lease.Attempt != 1 {
				t.Fatalf("%q: %+v, %v; want its lease, attempt 1", reqs[i].Key, rs[i], errs[i])
			}
			if err := s.Complete(ctx, rs[i].Lease, []byte("r")); err != nil {
				t.Fatalf("Complete %q: %v", reqs[i].Key, err)
			}
		}
	})
}

// failingTx fails every TransactWriteItems with err, before sending it.
type failingTx struct {
	dynamostore.Client
	err error
}

func (f *failingTx) TransactWriteItems(context.Context, *dynamodb.TransactWriteItemsInput, ...func(*dynamodb.Options)) (*dynamodb.TransactWriteItemsOutput, error) {
	return nil, f.err
}

// TestAcquireBatchRefused: a transaction that could not have taken effect
// (the connection refused) is every key's error, at once, with no key
// resent; one whose outcome is unknown makes each key's error wrap
// lock.ErrUnavailable once its retries fail too.
func TestAcquireBatchRefused(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		client, table := srv.sharedTable(t)
		refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
		s, err := dynamostore.New(&failingTx{client, refused}, dynamostore.Config{Table: table, Config: lock.Config{Prefix: testenv.Name(t)}})
		if err != nil {
			t.Fatal(err)
		}
		_, errs := s.AcquireBatch(context.Background(), []lock.Request{{Key: "a"}, {Key: "b"}})
		for _, err := range errs {
			if !errors.Is(err, lock.ErrUnavailable) || !strings.Contains(err.Error(), "acquire batch of 2") {
				t.Fatalf("refused: got %v, want the batch's ErrUnavailable", err)
			}
		}
		if res, err := s.Acquire(context.Background(), lock.Request{Key: "a"}); err != nil || res.Status != lock.Acquired {
			t.Fatalf("after the refused batch: %v, %v; want the key free", res.Status, err)
		}
	})
}

// TestAcquireBatchCancelledWithoutReasons: a transaction cancelled with no
// reason per item wrote nothing; its keys are taken one by one, not
// answered with its error.
func TestAcquireBatchCancelledWithoutReasons(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		client, table := srv.sharedTable(t)
		cancelled := &types.TransactionCanceledException{Message: aws.String("Transaction cancelled")}
		s, err := dynamostore.New(&failingTx{client, cancelled}, dynamostore.Config{Table: table, Config: lock.Config{Prefix: testenv.Name(t)}})
		if err != nil {
			t.Fatal(err)
		}
		reqs := []lock.Request{{Key: "a"}, {Key: "b"}}
		rs, errs := s.AcquireBatch(context.Background(), reqs)
		for i := range reqs {
			if errs[i] != nil || rs[i].Status != lock.Acquired {
				t.Fatalf("%q: %v, %v; want its lease, taken on its own", reqs[i].Key, rs[i].Status, errs[i])
			}
		}
	})
}
