//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"

	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 7, latency and timeouts on the links: the consumers reach Redis
// and RabbitMQ through toxiproxy proxies run in the test process (loopback
// only), and the links get, one after the other, latency, a black hole
// (data dropped, connection left open), resets, a bandwidth limit and
// sliced writes, while operations keep arriving.
func TestChaos07Toxiproxy(t *testing.T) {
	e := newEnv(t, envOptions{})
	perPhase := pick(60, 250)

	// toxiproxy logs some events through zerolog's global logger.
	zerolog.SetGlobalLevel(zerolog.Disabled)
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	amqpURL, err := url.Parse(e.amqp)
	if err != nil {
		t.Fatal(err)
	}
	redisProxy := addProxy(t, srv, e.name+"-redis", e.redis.Addr)
	amqpProxy := addProxy(t, srv, e.name+"-amqp", amqpURL.Host)
	amqpURL.Host = amqpProxy.Listen
	flags := []string{"-amqp", amqpURL.String(), "-redis", redisProxy.Listen,
		"-heartbeat", "2s", "-redis-timeout", "500ms", "-lease", "2s",
		"-in-progress-delay", "300ms", "-unavailable-delay", "300ms", "-concurrency", "8"}
	for i := range 2 {
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), flags...)
	}

	d := func(short, long time.Duration) time.Duration { return pick(short, long) }
	phases := []struct {
		what  string
		proxy *toxiproxy.Proxy
		toxic string
		dur   time.Duration
	}{
		{"redis: 100±50 ms latency", redisProxy, `{"type":"latency","stream":"downstream","attributes":{"latency":100,"jitter":50}}`, d(2*time.Second, 4*time.Second)},
		{"redis: 700 ms latency (over the client timeout)", redisProxy, `{"type":"latency","stream":"upstream","attributes":{"latency":700}}`, d(3*time.Second, 4*time.Second)},
		{"redis: black hole", redisProxy, `{"type":"timeout","stream":"downstream","attributes":{"timeout":0}}`, 3 * time.Second},
		{"redis: connections reset", redisProxy, `{"type":"reset_peer","stream":"upstream","attributes":{"timeout":200}}`, 2 * time.Second},
		{"amqp: 300 ms latency", amqpProxy, `{"type":"latency","stream":"downstream","attributes":{"latency":300}}`, d(2*time.Second, 4*time.Second)},
		{"amqp: 16 KB/s", amqpProxy, `{"type":"bandwidth","stream":"downstream","attributes":{"rate":16}}`, d(2*time.Second, 3*time.Second)},
		{"amqp: writes sliced", amqpProxy, `{"type":"slicer","stream":"upstream","attributes":{"average_size":16,"size_variation":8,"delay":200}}`, d(2*time.Second, 3*time.Second)},
		{"amqp: black hole (past the heartbeat)", amqpProxy, `{"type":"timeout","stream":"downstream","attributes":{"timeout":0}}`, 8 * time.Second},
	}
	total := 0
	for i, ph := range phases {
		toxic := fmt.Sprintf(`{"name":"chaos",%s`, strings.TrimPrefix(ph.toxic, "{"))
		if _, err := ph.proxy.Toxics.AddToxicJson(strings.NewReader(toxic)); err != nil {
			t.Fatalf("%s: %v", ph.what, err)
		}
		// The publisher is not proxied: the operations arrive while the
		// consumers' links are bad.
		e.publish(workload.Storm(fmt.Sprintf("%s-p%d-op", e.name, i), perPhase, 2, 50, e.rng))
		total += perPhase
		time.Sleep(ph.dur)
		if err := ph.proxy.Toxics.RemoveToxic(context.Background(), "chaos"); err != nil {
			t.Fatalf("%s: removing the toxic: %v", ph.what, err)
		}
		t.Logf("toxiproxy: %s for %v; %d of %d operations applied", ph.what, ph.dur, e.applied(), total)
	}
	e.settle(total, 5*time.Minute, 2*time.Second)
	e.terminateAll()
	e.report("toxiproxy", nil, false)
	outcomes := map[string]int{}
	for _, ev := range e.events() {
		outcomes[ev.Outcome+"/"+ev.Reason]++
	}
	t.Logf("toxiproxy: outcomes %v", outcomes)
}

// addProxy starts a toxiproxy proxy on a free loopback port to upstream,
// stopped in t.Cleanup.
func addProxy(t *testing.T, srv *toxiproxy.ApiServer, name, upstream string) *toxiproxy.Proxy {
	t.Helper()
	p := toxiproxy.NewProxy(srv, name, "127.0.0.1:0", upstream)
	if err := srv.Collection.Add(p, true); err != nil {
		t.Fatalf("toxiproxy %s: %v", name, err)
	}
	t.Cleanup(func() { _ = srv.Collection.Remove(name) })
	return p
}
