package pagebench_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// benchRecords is how many records the benchmarks seed: the issue's
// 100,000, every hundredth failed.
const benchRecords = 100_000

// benchKey is the i-th seeded key; every hundredth is failed.
// nextLink finds a records page's link to the next page, scanned the
// records it read (as the console's records tests do).
var (
	nextLink = regexp.MustCompile(`<a class="next" href="([^"]*)"`)
	scanned  = regexp.MustCompile(`<span class="scanned">(\d+)</span>`)
)

func benchKey(i int) string { return fmt.Sprintf("order-%06d", i) }

// seedRedis makes benchRecords records of endpoint in a RedisStore with a
// prefix of its own, through the store's own Acquire, Complete and Fail
// (64 at a time: the store pipelines them), and deletes them when b ends.
func seedRedis(b *testing.B, endpoint string) lock.Admin {
	client := testenv.RedisClient(b)
	prefix := "bench-" + testenv.Name(b)
	s, err := lock.NewRedisStore(client, lock.Config{Prefix: prefix, LeaseTTL: time.Hour, Retention: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		iter := client.Scan(ctx, 0, prefix+":{*", 5000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			if keys = append(keys, iter.Val()); len(keys) == 5000 {
				client.Unlink(ctx, keys...)
				keys = keys[:0]
			}
		}
		if len(keys) > 0 {
			client.Unlink(ctx, keys...)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // the seeding's bound
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < benchRecords; i += 64 {
				res, err := s.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey(endpoint, benchKey(i))})
				if err == nil && res.Status != lock.Acquired {
					err = fmt.Errorf("acquire %d: %v", i, res.Status)
				}
				if err == nil && i%100 == 0 {
					err = s.Fail(ctx, res.Lease, "card declined")
				} else if err == nil {
					err = s.Complete(ctx, res.Lease, []byte("ok"))
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatal(err)
	}
	return s
}

// seedPostgres makes benchRecords records of endpoint in a pgstore table
// of a schema of its own with one COPY, and drops the schema when b ends.
func seedPostgres(b *testing.B, endpoint string) lock.Admin {
	pool := pgenv.Pool(b, 8)
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(b)), CleanupInterval: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // the seeding's bound
	defer cancel()
	if err := pgstore.Migrate(ctx, pool, cfg); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	now := time.Now()
	rows := make([][]any, benchRecords)
	for i := range rows {
		state, value := "c", []byte("ok")
		if i%100 == 0 {
			state, value = "f", []byte("card declined")
		}
		rows[i] = []any{lock.DefaultPrefix, []byte(amqpidem.StoreKey(endpoint, benchKey(i))), state, "owner", now.UnixMicro() + int64(i), nil, 1,
			[]byte{}, value, now, now, now.Add(time.Hour)}
	}
	n, err := pool.CopyFrom(ctx, pgx.Identifier{cfg.Schema, "amqpidem_records"},
		[]string{"ns", "key", "state", "owner", "fence", "deadline", "attempts", "fingerprint", "value", "created_at", "ended_at", "expires_at"},
		pgx.CopyFromRows(rows))
	if err != nil || n != benchRecords {
		b.Fatalf("COPY: %d rows, %v", n, err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+pgx.Identifier{cfg.Schema, "amqpidem_records"}.Sanitize()); err != nil {
		b.Fatal(err)
	}
	s, err := pgstore.New(pool, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(s.Close)
	return s
}

// BenchmarkPage100k loads console pages (server time: ServeHTTP into a
// recorder) against 100,000 records of one endpoint, 1,000 of them
// failed: the overview (counts by state), the first page of failed
// records and a page deep in the listing, on Redis and on PostgreSQL.
// records-read/op is what the page read from the store: a page, not the
// store.
func BenchmarkPage100k(b *testing.B) {
	for _, store := range []struct {
		name string
		seed func(*testing.B, string) lock.Admin
	}{{"redis", seedRedis}, {"postgres", seedPostgres}} {
		b.Run(store.name, func(b *testing.B) {
			endpoint := "payments"
			admin := store.seed(b, endpoint)
			h, err := console.New(console.Config{Admin: admin, Queues: []string{endpoint}, Logger: discard()})
			if err != nil {
				b.Fatal(err)
			}
			// A cursor deep in the listing: the 40th page of failed
			// records.
			deep := "/records?endpoint=" + endpoint + "&state=failed"
			for range 40 {
				page := serveOnce(b, h, deep)
				m := nextLink.FindStringSubmatch(page)
				if m == nil {
					break
				}
				deep = "/" + strings.ReplaceAll(m[1], "&amp;", "&")
			}
			for _, p := range []struct{ name, path string }{
				{"overview", "/"},
				{"failed-first", "/records?endpoint=" + endpoint + "&state=failed"},
				{"failed-deep", deep},
				{"all-first", "/records?endpoint=" + endpoint},
			} {
				b.Run(p.name, func(b *testing.B) {
					read, exact := 0, 0
					for b.Loop() {
						page := serveOnce(b, h, p.path)
						if p.name == "overview" {
							exact += overviewCount(b, store.name, page)
						}
						if m := scanned.FindStringSubmatch(page); m != nil {
							n, _ := strconv.Atoi(m[1])
							read += n
						}
					}
					if p.name != "overview" {
						b.ReportMetric(float64(read)/float64(b.N), "records-read/op")
					} else {
						b.ReportMetric(float64(exact)/float64(b.N), "exact-counts/op")
					}
				})
			}
			if store.name == "postgres" {
				// What an exact count of the 100,000 costs, given a
				// budget it never reaches (the overview's default is
				// 100 ms).
				h, err := console.New(console.Config{Admin: admin, Queues: []string{endpoint}, Logger: discard(), CountBudget: time.Minute})
				if err != nil {
					b.Fatal(err)
				}
				b.Run("overview-exact", func(b *testing.B) {
					for b.Loop() {
						if overviewCount(b, store.name, serveOnce(b, h, "/")) != 1 {
							b.Fatal("no exact count within a minute")
						}
					}
				})
			}
		})
	}
}

// overviewCount checks how an overview on store counted the endpoint's
// records and says whether exactly (1) or among a page (0): on Redis
// always among a page; on PostgreSQL exactly, or among a page when the
// count ran over its budget.
func overviewCount(b *testing.B, store, page string) int {
	switch {
	case store == "postgres" && strings.Contains(page, "exact: 100000 records"):
		return 1
	case store == "postgres" && strings.Contains(page, "took more than its") && strings.Contains(page, "among the first 1000 records read"):
		return 0
	case store == "redis" && strings.Contains(page, "among the first "):
		return 0
	}
	b.Fatalf("overview on %s: no count of the records:\n%s", store, page)
	return 0
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }

// serveOnce serves path with h and returns the page, failing b on any
// status but 200.
func serveOnce(b *testing.B, h http.Handler, path string) string {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	if rec.Code != http.StatusOK {
		b.Fatalf("GET %s: %d\n%s", path, rec.Code, rec.Body)
	}
	return rec.Body.String()
}
