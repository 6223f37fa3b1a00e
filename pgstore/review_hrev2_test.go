package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// adversarialKeys are keys whose bytes an array's text form would have to
// quote or escape (quotes, backslashes, braces, commas, spaces, NULL as a
// word), or that are not text at all (NUL, non-UTF-8), and the empty key.
var adversarialKeys = []string{
	"", " ", "a b", `"`, `\`, `\\"`, "{", "}", "{}", "{a,b}", ",", "a,b",
	"NULL", "null", `"NULL"`, "'", "''", "\x00", "a\x00b", "\xff\xfe", "\\x00",
	"é", "\t\n\r", "}{\",\\", strings.Repeat("k", 300),
}

// adversarialValue is the result of message i: nil (completed with an
// empty value), empty, or bytes an array's text form would have to escape.
func adversarialValue(i int) []byte {
	switch i % 5 {
	case 0:
		return nil
	case 1:
		return []byte{}
	case 2:
		return []byte("NULL")
	case 3:
		return []byte{0, '\\', '"', '{', ',', '}', 0xff}
	}
	return fmt.Appendf(nil, "v%d", i)
}

// TestBatchArraysAdversarialKeysEveryMode: under every pgx query mode, a
// batch of 1, of the adversarial keys and of 1000 keys is acquired and
// completed, some messages declined, then asked again: the table then holds exactly the
// batch's keys, each with the owner and fence its lease was given, the
// declined still pending, the others completed with their own value (a nil
// result as an empty value, not NULL), and no other row.
func TestBatchArraysAdversarialKeysEveryMode(t *testing.T) {
	ctx := context.Background()
	modes := []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	}
	big := make([]string, 1000)
	for i := range big {
		big[i] = adversarialKeys[i%len(adversarialKeys)] + fmt.Sprintf("#%d", i)
	}
	batches := map[string][]string{"one": {`{"a\x00",}`}, "adversarial": adversarialKeys, "thousand": big}
	for _, mode := range modes {
		for bname, keys := range batches {
			t.Run(mode.String()+"/"+bname, func(t *testing.T) {
				pool, store, cfg := storeOn(t, func(pcfg *pgxpool.Config) {
					pcfg.MaxConns = 2
					pcfg.ConnConfig.DefaultQueryExecMode = mode
				})
				// Run twice: the second time the prepared statements
				// are cached (and, past five runs, may be generic).
				for round := range 2 {
					prefix := fmt.Sprintf("r%d-", round)
					reqs := make([]lock.Request, len(keys))
					for i, k := range keys {
						reqs[i] = lock.Request{Key: prefix + k, TTL: time.Minute, Fingerprint: k[:min(len(k), 100)]}
					}
					rs, errs := store.AcquireBatch(ctx, reqs)
					items := make([]amqpidem.BatchItem, len(rs))
					for i, r := range rs {
						if errs[i] != nil || r.Status != lock.Acquired || r.Lease.Key != reqs[i].Key {
							t.Fatalf("AcquireBatch %d (%q): %+v, %v", i, reqs[i].Key, r, errs[i])
						}
						items[i] = amqpidem.BatchItem{Delivery: &amqp.Delivery{}, Lease: r.Lease}
					}
					checkRecords(t, pool, cfg.Schema, prefix, rs, nil)
					declined := func(i int) bool { return len(keys) > 1 && i%7 == 3 }
					h := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
						out := make([]amqpidem.BatchResult, len(ds))
						for j, d := range ds {
							i := int(d.DeliveryTag)
							if declined(i) {
								out[j].Err = amqpidem.Permanent(errors.New("declined"))
							} else {
								out[j].Result = adversarialValue(i)
							}
						}
						return out, nil
					}).(amqpidem.BatchCompleter)
					for i := range items {
						items[i].Delivery.DeliveryTag = uint64(i)
					}
					res, err := h.HandleBatchComplete(ctx, items, func(_ int, r []byte) ([]byte, error) { return r, nil })
					if err != nil {
						t.Fatal(err)
					}
					for i, r := range res {
						if (r.Err != nil) != declined(i) {
							t.Fatalf("message %d: %v (declined %v)", i, r.Err, declined(i))
						}
					}
					checkRecords(t, pool, cfg.Schema, prefix, rs, func(i int) (bool, []byte) {
						return !declined(i), adversarialValue(i)
					})
					// Again: each completed key answers its own value (the
					// rows scanned into the same variables), each declined
					// one InProgress.
					again, errs := store.AcquireBatch(ctx, reqs)
					for i, a := range again {
						switch {
						case errs[i] != nil:
							t.Fatalf("duplicate %d: %v", i, errs[i])
						case declined(i) && a.Status != lock.InProgress:
							t.Errorf("declined %d (%q): %v, want in progress", i, reqs[i].Key, a.Status)
						case !declined(i) && (a.Status != lock.Completed || !bytes.Equal(a.Value, adversarialValue(i)) || a.Value == nil && adversarialValue(i) != nil):
							t.Errorf("duplicate %d (%q): %v %q, want completed with %q", i, reqs[i].Key, a.Status, a.Value, adversarialValue(i))
						}
					}
				}
			})
		}
	}
}

// checkRecords checks that the records of the table whose keys begin with
// prefix are exactly those of rs's leases, each with its lease's owner (a
// token of its own) and fence, and, where done is given, completed (state c, the value, nil as
// empty) or still pending.
func checkRecords(t *testing.T, pool *pgxpool.Pool, schema, prefix string, rs []lock.Result, done func(int) (bool, []byte)) {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		"SELECT key, state, owner, fence, value FROM "+pgx.Identifier{schema, pgstore.DefaultTable}.Sanitize()+
			" WHERE substring(key FROM 1 FOR $1) = $2::bytea", len(prefix), []byte(prefix))
	if err != nil {
		t.Fatal(err)
	}
	type rec struct {
		state, owner string
		fence        int64
		value        []byte
	}
	got := map[string]rec{}
	for rows.Next() {
		var k []byte
		var r rec
		if err := rows.Scan(&k, &r.state, &r.owner, &r.fence, &r.value); err != nil {
			t.Fatal(err)
		}
		got[string(k)] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(rs) {
		t.Errorf("%d records, want %d", len(got), len(rs))
	}
	owners := map[string]int{}
	for i, res := range rs {
		l := res.Lease
		if o, dup := owners[l.Owner]; dup || len(l.Owner) != 32 {
			t.Errorf("lease %d (%q): owner %q, lease %d's too (or not 32 digits)", i, l.Key, l.Owner, o)
		}
		owners[l.Owner] = i
		r, ok := got[l.Key]
		switch {
		case !ok:
			t.Errorf("lease %d (%q): no record", i, l.Key)
			continue
		case r.owner != l.Owner || r.fence != l.Fence:
			t.Errorf("lease %d (%q): record's owner/fence %q/%d, the lease's %q/%d", i, l.Key, r.owner, r.fence, l.Owner, l.Fence)
		}
		if done == nil {
			if r.state != "p" {
				t.Errorf("lease %d (%q): state %q, want p", i, l.Key, r.state)
			}
			continue
		}
		completed, v := done(i)
		switch {
		case !completed && r.state != "p":
			t.Errorf("declined %d (%q): state %q, want p (still leased)", i, l.Key, r.state)
		case completed && (r.state != "c" || r.value == nil || !bytes.Equal(r.value, v)):
			t.Errorf("completed %d (%q): state %q value %q (nil %v), want c with %q", i, l.Key, r.state, r.value, r.value == nil, v)
		}
	}
}
