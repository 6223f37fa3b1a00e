package lock_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// A prefix holding SCAN's pattern characters lists its own records only,
// and a cursor List did not give is refused.
func TestRedisListPatternPrefix(t *testing.T) {
	client := testenv.RedisClient(t)
	base := testenv.Name(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	star := newRedisStore(t, client, lock.Config{Prefix: base + "*[a]"})
	other := newRedisStore(t, client, lock.Config{Prefix: base + "xa"})
	for _, s := range []*lock.RedisStore{star, other} {
		if _, err := s.Acquire(ctx, lock.Request{Key: "k"}); err != nil {
			t.Fatal(err)
		}
	}
	n := 0
	for req := (lock.ListRequest{Scan: 500}); ; {
		p, err := star.List(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range p.Records {
			if !strings.HasPrefix(r.Location, "redis key "+base+"*[a]:{") {
				t.Fatalf("listed %s, another prefix's record", r.Location)
			}
			n++
		}
		if req.Cursor = p.Next; p.Next == "" {
			break
		}
	}
	if got, want := n, 1; got != want {
		t.Fatalf("records listed: got %d, want %d", got, want)
	}
	if _, err := star.List(ctx, lock.ListRequest{Cursor: "not-a-cursor"}); !errors.Is(err, lock.ErrBadCursor) {
		t.Fatalf("List with a bad cursor: got %v, want ErrBadCursor", err)
	}
}
