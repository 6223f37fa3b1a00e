package dynamostore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/storetest"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

func TestStoreConformance(t *testing.T) {
	eachServerInTurn(t, func(t *testing.T, srv *server) {
		storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
			return srv.newStore(t, dynamostore.Config{Config: cfg})
		})
	})
}

func TestCheckAndPing(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		ctx := context.Background()
		if err := s.Check(ctx); err != nil {
			t.Fatalf("Check: %v", err)
		}
		if err := s.Ping(ctx); err != nil {
			t.Fatalf("Ping: %v", err)
		}
	})
}

// clock is a settable clock for Config.Now.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// TestClockSkewDelaysTakeover: an expired lease is taken over only once
// its deadline is MaxClockSkew past by the taker's clock.
func TestClockSkewDelaysTakeover(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		holderClock, takerClock := &clock{t: time.Now()}, &clock{}
		prefix := testenv.Name(t)
		holder := srv.newStore(t, dynamostore.Config{Config: lock.Config{Prefix: prefix, Now: holderClock.Now}, MaxClockSkew: time.Second})
		taker := srv.newStore(t, dynamostore.Config{Config: lock.Config{Prefix: prefix, Now: takerClock.Now}, MaxClockSkew: time.Second})
		ctx := context.Background()
		res, err := holder.Acquire(ctx, lock.Request{Key: "k", TTL: 2 * time.Second})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire: %+v, %v", res, err)
		}
		deadline := holderClock.Now().Add(2 * time.Second)
		for _, tc := range []struct {
			after time.Duration
			want  lock.Status
		}{
			{-time.Millisecond, lock.InProgress},
			{500 * time.Millisecond, lock.InProgress},         // expired, within the skew
			{time.Second, lock.InProgress},                    // at the skew's end
			{time.Second + 2*time.Millisecond, lock.Acquired}, // past it
		} {
			takerClock.set(deadline.Add(tc.after))
			got, err := taker.Acquire(ctx, lock.Request{Key: "k", TTL: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if got.Status != tc.want {
				t.Fatalf("deadline%+v: got %v, want %v (%+v)", tc.after, got.Status, tc.want, got)
			}
			if got.Status == lock.InProgress && got.Remaining <= 0 {
				t.Fatalf("deadline%+v: in progress with %v remaining", tc.after, got.Remaining)
			}
			if got.Status == lock.Acquired && (got.Lease.Fence <= res.Lease.Fence || got.Lease.Attempt != 2) {
				t.Fatalf("takeover: %+v after %+v", got.Lease, res.Lease)
			}
		}
		if err := holder.Complete(ctx, res.Lease, nil); !errors.Is(err, lock.ErrLeaseLost) {
			t.Fatalf("Complete by the holder after the takeover: got %v, want ErrLeaseLost", err)
		}
	})
}

// TestClockSkewWithShortRetention: the skew rule holds for every record in
// progress, also one whose item has expired (deadline + Retention) within
// the skew: with Retention at most MaxClockSkew, a takeover between the
// item's expiry and deadline + MaxClockSkew would make two owners at once
// for a holder whose clock is behind by less than the skew allowed.
func TestClockSkewWithShortRetention(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		for _, retention := range []time.Duration{time.Millisecond, 300 * time.Millisecond, time.Second} {
			t.Run(retention.String(), func(t *testing.T) {
				holderClock, takerClock := &clock{t: time.Now()}, &clock{}
				prefix := testenv.Name(t)
				lc := func(c *clock) lock.Config { return lock.Config{Prefix: prefix, Now: c.Now, Retention: retention} }
				holder := srv.newStore(t, dynamostore.Config{Config: lc(holderClock), MaxClockSkew: time.Second})
				taker := srv.newStore(t, dynamostore.Config{Config: lc(takerClock), MaxClockSkew: time.Second})
				ctx := context.Background()
				res, err := holder.Acquire(ctx, lock.Request{Key: "k", TTL: 2 * time.Second})
				if err != nil || res.Status != lock.Acquired {
					t.Fatalf("Acquire: %+v, %v", res, err)
				}
				deadline := holderClock.Now().Add(2 * time.Second)
				for _, tc := range []struct {
					after time.Duration
					want  lock.Status
				}{
					{retention, lock.InProgress},                                    // the item's expiry
					{min(retention+time.Millisecond, time.Second), lock.InProgress}, // past it, within the skew
					{time.Second, lock.InProgress},                                  // at the skew's end
					{time.Second + 2*time.Millisecond, lock.Acquired},               // past it
				} {
					takerClock.set(deadline.Add(tc.after))
					got, err := taker.Acquire(ctx, lock.Request{Key: "k", TTL: 2 * time.Second})
					if err != nil {
						t.Fatal(err)
					}
					if got.Status != tc.want {
						t.Fatalf("deadline%+v: got %v, want %v (%+v)", tc.after, got.Status, tc.want, got)
					}
					if got.Status == lock.InProgress && got.Remaining <= 0 {
						t.Fatalf("deadline%+v: in progress with %v remaining", tc.after, got.Remaining)
					}
					if got.Status == lock.Acquired && got.Lease.Fence <= res.Lease.Fence {
						t.Fatalf("takeover: %+v after %+v", got.Lease, res.Lease)
					}
				}
			})
		}
	})
}

// countingClient counts the UpdateItem calls in flight, and can fail them.
type countingClient struct {
	dynamostore.Client
	mu            sync.Mutex
	inFlight, max int
	fail          error
}

func (c *countingClient) UpdateItem(ctx context.Context, in *dynamodb.UpdateItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.UpdateItemOutput, error) {
	c.mu.Lock()
	c.inFlight++
	c.max = max(c.max, c.inFlight)
	fail := c.fail
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.inFlight--
		c.mu.Unlock()
	}()
	if fail != nil {
		return nil, fail
	}
	time.Sleep(5 * time.Millisecond)
	return c.Client.UpdateItem(ctx, in, opts...)
}

func TestExtendBoundedConcurrency(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		client, table := srv.sharedTable(t)
		cc := &countingClient{Client: client}
		s, err := dynamostore.New(cc, dynamostore.Config{Table: table, Config: lock.Config{Prefix: testenv.Name(t)}, ExtendConcurrency: 3})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		var leases []lock.Lease
		for i := range 12 {
			res, err := s.Acquire(ctx, lock.Request{Key: fmt.Sprint("k", i)})
			if err != nil {
				t.Fatal(err)
			}
			leases = append(leases, res.Lease)
		}
		if err := s.Release(ctx, leases[5]); err != nil {
			t.Fatal(err)
		}
		cc.mu.Lock()
		cc.max = 0
		cc.mu.Unlock()
		for i, err := range s.Extend(ctx, leases...) {
			if i == 5 {
				if !errors.Is(err, lock.ErrLeaseLost) {
					t.Fatalf("Extend of the released lease: got %v, want ErrLeaseLost", err)
				}
			} else if err != nil {
				t.Fatalf("Extend %d: %v", i, err)
			}
		}
		if got, want := cc.max, 3; got > want || got < 2 {
			t.Fatalf("UpdateItem calls at once: got %d, want up to %d (and more than 1)", got, want)
		}

		// Throttling is lock.ErrUnavailable, for every call.
		cc.fail = &types.ProvisionedThroughputExceededException{Message: aws.String("slow down")}
		if err := s.Extend(ctx, leases[0])[0]; !errors.Is(err, lock.ErrUnavailable) {
			t.Fatalf("throttled Extend: got %v, want ErrUnavailable", err)
		}
		if err := s.Complete(ctx, leases[0], nil); !errors.Is(err, lock.ErrUnavailable) {
			t.Fatalf("throttled Complete: got %v, want ErrUnavailable", err)
		}
		if _, err := s.Acquire(ctx, lock.Request{Key: "new"}); !errors.Is(err, lock.ErrUnavailable) {
			t.Fatalf("throttled Acquire: got %v, want ErrUnavailable", err)
		}
	})
}

func TestMissingTableUnavailable(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s, err := dynamostore.New(srv.newClient(), dynamostore.Config{Table: testenv.Name(t) + "-missing"})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		if _, err := s.Acquire(ctx, lock.Request{Key: "k"}); !errors.Is(err, lock.ErrUnavailable) || !strings.Contains(err.Error(), "CreateTable") {
			t.Fatalf("Acquire on a missing table: got %v, want ErrUnavailable saying to create it", err)
		}
		if err := s.Check(ctx); err == nil {
			t.Fatal("Check of a missing table: no error")
		}
	})
}

// TestFenceKeptByExpiredItemAndTombstone: the item outlives its record, and
// Forget leaves a tombstone that keeps the fence, so a record made again
// gets a higher fence, after Forget even from a clock that is behind the
// last one.
func TestFenceKeptByExpiredItemAndTombstone(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		clk, prefix := &clock{t: time.Now()}, testenv.Name(t)
		s := srv.newStore(t, dynamostore.Config{Config: lock.Config{Prefix: prefix, Now: clk.Now, Retention: time.Second}})
		ctx := context.Background()
		first, err := s.Acquire(ctx, lock.Request{Key: "k"})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, first.Lease, []byte("secret")); err != nil {
			t.Fatal(err)
		}
		// The record expires, its item stays.
		clk.set(clk.Now().Add(2 * time.Second))
		if _, err := s.Inspect(ctx, "k"); !errors.Is(err, lock.ErrNotFound) {
			t.Fatalf("Inspect of an expired record: got %v, want ErrNotFound", err)
		}
		again, err := s.Acquire(ctx, lock.Request{Key: "k"})
		if err != nil || again.Status != lock.Acquired || again.Lease.Attempt != 1 || again.Lease.Fence <= first.Lease.Fence {
			t.Fatalf("after expiry: %+v, %v; want a new record with a fence above %d", again, err, first.Lease.Fence)
		}
		if err := s.Complete(ctx, again.Lease, nil); err != nil {
			t.Fatal(err)
		}
		if err := s.Forget(ctx, "k", lock.StateCompleted, again.Lease.Fence); err != nil {
			t.Fatal(err)
		}
		// The tombstone keeps the fence and nothing else.
		client, table := srv.sharedTable(t)
		out, err := client.GetItem(ctx, &dynamodb.GetItemInput{
			TableName:      aws.String(table),
			Key:            map[string]types.AttributeValue{"pk": &types.AttributeValueMemberB{Value: []byte(prefix + "\x00k")}},
			ConsistentRead: aws.Bool(true),
		})
		if err != nil {
			t.Fatal(err)
		}
		st, _ := out.Item["st"].(*types.AttributeValueMemberS)
		v, _ := out.Item["v"].(*types.AttributeValueMemberB)
		if st == nil || st.Value != "d" || v == nil || len(v.Value) != 1 {
			t.Fatalf("tombstone: %v, want state d and an empty value", out.Item)
		}
		clk.set(clk.Now().Add(-time.Minute))
		third, err := s.Acquire(ctx, lock.Request{Key: "k"})
		if err != nil || third.Status != lock.Acquired || third.Lease.Attempt != 1 || third.Lease.Fence <= again.Lease.Fence {
			t.Fatalf("after Forget and a clock stepped back: %+v, %v; want a new record with a fence above %d", third, err, again.Lease.Fence)
		}
	})
}

// TestUnreachableUnavailableWithinContext: a DynamoDB that cannot be
// reached is lock.ErrUnavailable, the SDK's retries included, within the
// caller's context.
func TestUnreachableUnavailableWithinContext(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	client := dynamodb.New(dynamodb.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String("http://" + addr),
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "test", SecretAccessKey: "test"}, nil
		}),
	})
	s, err := dynamostore.New(client, dynamostore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	_, err = s.Acquire(ctx, lock.Request{Key: "k"})
	if !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Acquire of an unreachable DynamoDB: got %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Acquire took %v with a 1s context", d)
	}
	l2 := lock.Lease{Key: "k", Owner: "o", Fence: 1, TTL: time.Second, Retention: time.Second}
	if err := s.Extend(ctx, l2)[0]; !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Extend of an unreachable DynamoDB: got %v, want ErrUnavailable", err)
	}
}

// TestCreateTableTwiceAndTTL: CreateTable on a records table that exists
// (TTL on already, which DynamoDB refuses to enable twice) succeeds, and
// on a table whose TTL is on another attribute fails, leaving it there
// (DynamoDB has one TTL attribute per table; minidyn's stand-in moves it,
// so that part runs on DynamoDB Local only).
func TestCreateTableTwiceAndTTL(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		ctx := context.Background()
		cfg := dynamostore.Config{Table: testenv.Name(t)}
		t.Cleanup(func() {
			_, _ = srv.client.DeleteTable(context.Background(), &dynamodb.DeleteTableInput{TableName: aws.String(cfg.Table)})
		})
		for i := range 2 {
			if err := dynamostore.CreateTable(ctx, srv.client, cfg); err != nil {
				t.Fatalf("CreateTable, time %d: %v", i+1, err)
			}
		}
		ttl, err := srv.client.DescribeTimeToLive(ctx, &dynamodb.DescribeTimeToLiveInput{TableName: aws.String(cfg.Table)})
		if err != nil {
			t.Fatal(err)
		}
		if d := ttl.TimeToLiveDescription; d.TimeToLiveStatus != types.TimeToLiveStatusEnabled || aws.ToString(d.AttributeName) != "ttl" {
			t.Fatalf("TTL after CreateTable: %s on %q, want ENABLED on \"ttl\"", d.TimeToLiveStatus, aws.ToString(d.AttributeName))
		}
		if !srv.Strict {
			t.Skipf("%s's TTL is a stand-in that moves the TTL attribute when asked", srv.Name)
		}
		other := dynamostore.Config{Table: testenv.Name(t)}
		t.Cleanup(func() {
			_, _ = srv.client.DeleteTable(context.Background(), &dynamodb.DeleteTableInput{TableName: aws.String(other.Table)})
		})
		if _, err := srv.client.CreateTable(ctx, dynamostore.TableInput(other.Table)); err != nil {
			t.Fatal(err)
		}
		if _, err := srv.client.UpdateTimeToLive(ctx, &dynamodb.UpdateTimeToLiveInput{
			TableName:               aws.String(other.Table),
			TimeToLiveSpecification: &types.TimeToLiveSpecification{AttributeName: aws.String("expires_at"), Enabled: aws.Bool(true)},
		}); err != nil {
			t.Fatal(err)
		}
		err = dynamostore.CreateTable(ctx, srv.client, other)
		if err == nil || !strings.Contains(err.Error(), `TTL on the attribute "ttl"`) {
			t.Fatalf("CreateTable on a table whose TTL is on expires_at: got %v, want an error about TTL on \"ttl\"", err)
		}
		ttl, err = srv.client.DescribeTimeToLive(ctx, &dynamodb.DescribeTimeToLiveInput{TableName: aws.String(other.Table)})
		if err != nil || aws.ToString(ttl.TimeToLiveDescription.AttributeName) != "expires_at" {
			t.Fatalf("TTL after the refused CreateTable: %+v, %v; want still on expires_at", ttl, err)
		}
	})
}

// TestItemDeletedByTTL: DynamoDB Local deletes an item once its TTL
// attribute has passed (within a second or so here; DynamoDB within
// days), as minidyn never does. A store whose clock is 3 days behind
// writes TTLs already past, so its item vanishes under its lease: every
// method then finds no record, and the key is made anew with a higher
// fence. The test keeps its table in a database of its own (an access key
// of its own): DynamoDB Local's TTL deletion slows down, to more than a
// minute, in a database holding the tables of many earlier runs.
func TestItemDeletedByTTL(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		if !srv.Strict {
			t.Skipf("%s has no TTL: it never deletes an item", srv.Name)
		}
		key := fmt.Sprintf("ttl%08x", rand.Uint32()) // DynamoDB Local takes letters and digits
		client := dynamodb.New(dynamodb.Options{
			Region:       testenv.DynamoRegion,
			BaseEndpoint: aws.String(srv.Endpoint),
			Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
				return aws.Credentials{AccessKeyID: key, SecretAccessKey: key}, nil
			}),
		})
		ctx := context.Background()
		table := testenv.Name(t)
		if err := dynamostore.CreateTable(ctx, client, dynamostore.Config{Table: table}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = client.DeleteTable(context.Background(), &dynamodb.DeleteTableInput{TableName: aws.String(table)})
		})
		behind := func() time.Time { return time.Now().Add(-72 * time.Hour) }
		s, err := dynamostore.New(client, dynamostore.Config{Table: table, MaxClockSkew: testSkew, Config: lock.Config{Now: behind}})
		if err != nil {
			t.Fatal(err)
		}
		res, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: time.Minute})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire: %+v, %v", res, err)
		}
		start := time.Now()
		for {
			_, err := s.Inspect(ctx, "k")
			if errors.Is(err, lock.ErrNotFound) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if time.Since(start) > 30*time.Second {
				t.Fatal("the item whose TTL passed a day ago is still there after 30 s")
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Logf("%s deleted the item %v after its Acquire", srv.Name, time.Since(start).Round(time.Millisecond))
		if err := s.Extend(ctx, res.Lease)[0]; !errors.Is(err, lock.ErrLeaseLost) {
			t.Fatalf("Extend after the item was deleted: got %v, want ErrLeaseLost", err)
		}
		if err := s.Complete(ctx, res.Lease, []byte("r")); !errors.Is(err, lock.ErrLeaseLost) {
			t.Fatalf("Complete after the item was deleted: got %v, want ErrLeaseLost", err)
		}
		if err := s.Forget(ctx, "k", lock.StateInProgress, res.Lease.Fence); !errors.Is(err, lock.ErrNotFound) {
			t.Fatalf("Forget after the item was deleted: got %v, want ErrNotFound", err)
		}
		again, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: time.Minute})
		if err != nil || again.Status != lock.Acquired || again.Lease.Attempt != 1 || again.Lease.Fence <= res.Lease.Fence {
			t.Fatalf("Acquire after the item was deleted: %+v, %v; want a new record with a fence above %d", again, err, res.Lease.Fence)
		}
	})
}
