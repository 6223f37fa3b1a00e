package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// commitCutter loses, once armed, the server's answer to the next COMMIT
// on a testenv.Proxy to PostgreSQL: when a CommandComplete "COMMIT" comes
// from the server (the transaction committed), it forwards nothing of
// it, runs then (while the client waits), and ends the connection.
type commitCutter struct {
	mu   sync.Mutex
	then func() // armed when non-nil
}

// arm makes the proxy cut the next COMMIT's answer, running then first.
func (p *commitCutter) arm(then func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.then = then
}

// commitComplete is a CommandComplete message of a COMMIT: 'C', its
// length (4 + 7), "COMMIT\x00".
var commitComplete = []byte("C\x00\x00\x00\x0bCOMMIT\x00")

// down copies what the server sends to the client until an armed cut.
func (p *commitCutter) down(server, client net.Conn) {
	buf := make([]byte, 64<<10)
	for {
		n, err := server.Read(buf)
		if n > 0 {
			p.mu.Lock()
			then := p.then
			cut := then != nil && bytes.Contains(buf[:n], commitComplete)
			if cut {
				p.then = nil
			}
			p.mu.Unlock()
			if cut {
				then()
				return
			}
			if _, werr := client.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// TestHeldLeaseCommitAnswerLost: a held lease's Release whose outcome
// committed on its session, but whose answer was lost with the session,
// is answered "unknown" (lock.ErrUnavailable), not lock.ErrLeaseLost
// ("nothing written"), even when the released record was taken over
// before the Store could look: the record it wrote is there, counted as
// an attempt by the next lease. (Found by test/linearizable's
// pgstore-held-terminate under -race.)
func TestHeldLeaseCommitAnswerLost(t *testing.T) {
	direct := pgenv.Pool(t, 4)
	u, err := url.Parse(pgenv.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cut := &commitCutter{}
	proxy := testenv.StartProxy(t, u.Host, nil, cut.down)
	pcfg, err := pgxpool.ParseConfig(proxy.URL(t, u.String()))
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 4
	ctx := context.Background()
	proxied, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxied.Close)

	cfg := schema(t, direct, pgstore.Config{CleanupInterval: -1})
	store := newStore(t, proxied, cfg)
	other := newStore(t, direct, cfg)

	failed := errors.New("handler failed")
	h := store.TxHandler(func(ctx context.Context, _ pgx.Tx, _ *amqp.Delivery) ([]byte, error) {
		return nil, failed
	}).(amqpidem.LeaseTaker)
	key := "answer-lost"
	res, err := h.AcquireLease(ctx, lock.Request{Key: key, TTL: 10 * time.Second}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: key}, res.Lease, same); !errors.Is(err, failed) {
		t.Fatalf("HandleComplete: %v, want the handler's error", err)
	}

	// The released record committed; before its answer reaches the
	// Store, another consumer's Acquire takes it over.
	type result struct {
		res lock.Result
		err error
	}
	took := make(chan result, 1)
	cut.arm(func() {
		r, err := other.Acquire(ctx, lock.Request{Key: key, TTL: 10 * time.Second})
		took <- result{r, err}
	})
	err = store.Release(ctx, res.Lease)
	var next lock.Result
	var nextErr error
	select {
	case r := <-took:
		next, nextErr = r.res, r.err
	default:
		t.Fatalf("Release answered %v without the COMMIT's answer being cut", err)
	}
	if nextErr != nil || next.Status != lock.Acquired || next.Lease.Attempt != 2 {
		t.Fatalf("the takeover: %+v, %v; want a lease of attempt 2 (the release committed)", next, nextErr)
	}
	if errors.Is(err, lock.ErrLeaseLost) || !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Release whose outcome committed and whose answer was lost: %v; want lock.ErrUnavailable (outcome unknown), not lock.ErrLeaseLost", err)
	}
	if err := other.Cancel(ctx, next.Lease); err != nil {
		t.Fatal(err)
	}
}
