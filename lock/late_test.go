package lock_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// lateConn delays the first script call written after arm: the write
// returns at once, but the bytes reach the server only once release is
// closed. The client meanwhile times out waiting for the reply (Read
// fails as a deadline would), drops the connection, and the Acquire is
// sent again on another one. When the held bytes go, the late call runs;
// its reply is read, so that ran is closed only after the server ran it,
// and dropped.
type lateConn struct {
	net.Conn
	armed   *atomic.Bool
	release <-chan struct{}
	ran     chan<- struct{}

	mu   sync.Mutex
	late bool // this connection holds the late call: it is the writer's now
}

func (c *lateConn) Write(b []byte) (int, error) {
	if bytes.Contains(bytes.ToLower(b), []byte("evalsha")) && c.armed.CompareAndSwap(true, false) {
		c.mu.Lock()
		c.late = true
		c.mu.Unlock()
		held := append([]byte(nil), b...)
		go func() {
			defer c.Conn.Close()
			defer close(c.ran)
			<-c.release
			if _, err := c.Conn.Write(held); err != nil {
				return
			}
			_ = c.Conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, _ = c.Conn.Read(make([]byte, 4096)) // the late call ran
		}()
		return len(b), nil
	}
	return c.Conn.Write(b)
}

func (c *lateConn) isLate() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.late
}

func (c *lateConn) Read(b []byte) (int, error) {
	if c.isLate() {
		time.Sleep(50 * time.Millisecond)
		return 0, &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	}
	return c.Conn.Read(b)
}

func (c *lateConn) Close() error {
	if c.isLate() {
		return nil // the writer closes it once the late call ran
	}
	return c.Conn.Close()
}

// A copy of an Acquire that reaches the server late, after the Acquire was
// sent again, got its lease and ended it, takes nothing: not a lease that
// nobody holds (which blocked the key for a TTL), not a second attempt.
// Both endings are tried: Release, and Cancel (which takes the attempt
// back: the late copy counted it again), on both Acquire paths.
func TestRedisLateAcquireTakesNothing(t *testing.T) {
	for _, native := range []bool{true, false} {
		for _, end := range []string{"release", "cancel"} {
			t.Run(fmt.Sprintf("native=%v/%s", native, end), func(t *testing.T) {
				var armed atomic.Bool
				release, ran := make(chan struct{}), make(chan struct{})
				client := redis.NewClient(&redis.Options{
					Addr:       testenv.RedisAddr(t),
					MaxRetries: -1,
					Dialer: wrapDialer(func(c net.Conn) net.Conn {
						return &lateConn{Conn: c, armed: &armed, release: release, ran: ran}
					}),
				})
				t.Cleanup(func() { client.Close() })
				s := newRedisStore(t, client, lock.Config{Prefix: testenv.Name(t)})
				if !native {
					lock.DisableNative(s)
				}
				ctx := context.Background()
				if err := s.Check(ctx); err != nil {
					t.Fatal(err)
				}
				// A record released once: the next Acquire runs the script.
				first, err := s.Acquire(ctx, lock.Request{Key: "k"})
				if err != nil || first.Status != lock.Acquired {
					t.Fatalf("first Acquire: %v %v", first.Status, err)
				}
				if err := s.Release(ctx, first.Lease); err != nil {
					t.Fatal(err)
				}

				armed.Store(true)
				res, err := s.Acquire(ctx, lock.Request{Key: "k"})
				if armed.Load() {
					t.Fatal("no script call was held back")
				}
				if err != nil || res.Status != lock.Acquired || res.Lease.Attempt != 2 {
					t.Fatalf("Acquire sent again: %v attempt %d %v; want acquired, attempt 2", res.Status, res.Lease.Attempt, err)
				}
				wantAttempt := 3
				if end == "release" {
					err = s.Release(ctx, res.Lease)
				} else {
					err = s.Cancel(ctx, res.Lease)
					wantAttempt = 2
				}
				if err != nil {
					t.Fatal(err)
				}
				close(release) // the late copy arrives
				select {
				case <-ran:
				case <-time.After(10 * time.Second):
					t.Fatal("the late call did not run")
				}
				next, err := s.Acquire(ctx, lock.Request{Key: "k"})
				if err != nil || next.Status != lock.Acquired || next.Lease.Attempt != wantAttempt {
					t.Fatalf("Acquire after the late copy ran: %v attempt %d %v; want acquired, attempt %d",
						next.Status, next.Attempts, err, wantAttempt)
				}
				if next.Fence <= res.Lease.Fence {
					t.Fatalf("fence %d after %d", next.Fence, res.Lease.Fence)
				}
			})
		}
	}
}
