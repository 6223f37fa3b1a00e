package linearizable_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// redisToxics are the link faults of TestRedisToxiproxy, one at a time:
// latency under and over the calls' 300 ms timeout (a request that
// arrives after its caller gave up is still applied: the call is
// ambiguous, and its effect lands late), a black hole (data dropped,
// connections left open) and connections reset.
var redisToxics = []struct{ name, toxic string }{
	{"latency", `{"type":"latency","stream":"downstream","attributes":{"latency":100,"jitter":50}}`},
	{"latency-over-timeout", `{"type":"latency","stream":"upstream","attributes":{"latency":400,"jitter":100}}`},
	{"black-hole", `{"type":"timeout","stream":"downstream","attributes":{"timeout":0}}`},
	{"reset", `{"type":"reset_peer","stream":"upstream","attributes":{"timeout":20}}`},
}

// TestRedisToxiproxy runs against a redis-server of the test's own reached
// through a toxiproxy proxy in the test process (loopback only), whose
// link gets the toxics above in turn, each for 0.3–0.8 s.
func TestRedisToxiproxy(t *testing.T) {
	srv := testenv.RedisServer(t, "--appendonly", "yes", "--appendfsync", "always")
	// toxiproxy logs some events through zerolog's global logger.
	zerolog.SetGlobalLevel(zerolog.Disabled)
	api := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	name := testenv.Name(t)
	proxy := toxiproxy.NewProxy(api, name, "127.0.0.1:0", srv.Addr)
	if err := api.Collection.Add(proxy, true); err != nil {
		t.Fatalf("toxiproxy: %v", err)
	}
	t.Cleanup(func() { _ = api.Collection.Remove(name) })
	s := redisStoreAt(t, proxy.Listen)
	w := faultWorkload()
	run := linearizable.Start(s, w)
	applied := map[string]int{}
	i := 0
	faults(run, 1000, 600*time.Millisecond, func() {
		tx := redisToxics[i%len(redisToxics)]
		i++
		toxic := fmt.Sprintf(`{"name":"fault",%s`, strings.TrimPrefix(tx.toxic, "{"))
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(toxic)); err != nil {
			t.Fatalf("toxic %s: %v", tx.name, err)
		}
		time.Sleep(time.Duration(300+rand.IntN(500)) * time.Millisecond)
		if err := proxy.Toxics.RemoveToxic(context.Background(), "fault"); err != nil {
			t.Fatalf("removing toxic %s: %v", tx.name, err)
		}
		applied[tx.name]++
	})
	res := check(t, "redis-toxiproxy", localClock, w, run.History())
	t.Logf("redis-toxiproxy: toxics %v, %d ambiguous operations", applied, res.Ambiguous)
	if res.Ambiguous == 0 {
		t.Errorf("redis-toxiproxy: no call was cut off: the toxics did not bite")
	}
	wantOK(t, res)
}
