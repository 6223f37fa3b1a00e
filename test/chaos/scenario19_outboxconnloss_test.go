//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/toxics"
	"github.com/rs/zerolog"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Scenario 19, outbox-connloss (issue 34 item 1): the pipeline of
// scenario 15a on the Redis store, stage A's consumers reaching RabbitMQ
// through a toxiproxy proxy in the test process. In phases, the proxy cuts
// the connection of a staged message's basic.publish, in both directions,
// before the broker gets it (a cutPublish toxic: most such publishes, on
// every connection that carries one), while operations keep arriving;
// between phases it lets everything through. Stage A's MaxAttempts is 3,
// so that a consumer that took a lost connection for the broker's refusal
// gives a message up after three cuts in a row, which each phase makes
// likely: such a message never reaches stage B (lost, given up). Nothing
// refused any message here; every one must reach stage B's ledger exactly
// once, and none be given up.
func TestChaos19OutboxConnLoss(t *testing.T) {
	o := newOutboxRun(t, false)
	phases, perPhase := pick(5, 12), pick(30, 150)
	on, off := pick(2500*time.Millisecond, 4*time.Second), pick(500*time.Millisecond, time.Second)
	const percent = 60 // of a phase's staged publishes cut

	zerolog.SetGlobalLevel(zerolog.Disabled)
	toxics.Register(cutPublishType, new(cutPublish))
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	amqpURL, err := url.Parse(o.amqp)
	if err != nil {
		t.Fatal(err)
	}
	proxy := addProxy(t, srv, o.name+"-amqp-a", amqpURL.Host)
	amqpURL.Host = proxy.Listen
	flagsA := append(append([]string(nil), o.flagsA...), "-amqp", amqpURL.String(), "-max-attempts", "3")
	supA := o.superviseAs(o.nameA, 2, flagsA...)
	supB := o.superviseAs(o.nameB, 2, o.flagsB...)

	// The staged messages' basic.publish names the run's exchange, which
	// nothing else stage A sends does (its requeues go through the default
	// exchange to delay queues or its own queue).
	toxic := fmt.Sprintf(`{"name":"cut","type":%q,"stream":"upstream","attributes":{"match":%q,"percent":%d}}`,
		cutPublishType, o.exchange, percent)
	var cut *cutPublish
	cuts := int64(0)
	total := 0
	for i := range phases {
		w, err := proxy.Toxics.AddToxicJson(strings.NewReader(toxic))
		if err != nil {
			t.Fatalf("phase %d: %v", i, err)
		}
		cut = w.Toxic.(*cutPublish)
		ops := o.outboxOps(fmt.Sprintf("p%d-op", i), perPhase, 50, nil, 0, 0)
		o.publish(ops)
		total += len(ops)
		time.Sleep(on)
		if err := proxy.Toxics.RemoveToxic(context.Background(), "cut"); err != nil {
			t.Fatalf("phase %d: removing the toxic: %v", i, err)
		}
		cuts += cut.cuts.Load()
		o.logf("phase %d: %d staged publishes cut (%d in all); %d of %d operations applied by stage B", i, cut.cuts.Load(), cuts, o.appliedB(), total)
		time.Sleep(off)
	}

	// Every operation reaches stage B, or is given up by stage A (as the
	// code before issue 34 did): wait for either, then for the queues.
	givenUp := func() int {
		n := 0
		for _, ev := range o.events() {
			if strings.HasPrefix(ev.Consumer, o.nameA) {
				n += ev.Returned
			}
		}
		return n
	}
	o.waitFor("every operation applied by stage B or given up by stage A", pick(2*time.Minute, 5*time.Minute),
		func() bool { return o.appliedB()+givenUp() >= total },
		func() string { return fmt.Sprintf("(applied %d, given up %d)", o.appliedB(), givenUp()) })
	o.waitDrained(time.Minute, time.Second)
	o.logf("settled")
	restartsA, errA := supA.halt()
	restartsB, errB := supB.halt()
	if errA != nil || errB != nil {
		t.Errorf("restarting consumers: %v %v", errA, errB)
	}
	o.terminateAll()
	f := o.examine()
	returned := 0
	for _, rec := range f.records {
		msgs, _ := amqpidem.StoredOutbox(rec.Value)
		for _, m := range msgs {
			if m.State == amqpidem.OutboxReturned {
				returned++
			}
		}
	}
	logged := o.grepAll("staged message given up")
	o.report("outbox-connloss", f, fmt.Sprintf(" phases=%d cuts=%d restarts=%d/%d given_up=%d", phases, cuts, restartsA, restartsB, returned))
	if returned != 0 || logged != 0 {
		t.Errorf("outbox-connloss: %d staged messages given up (%d logged) for lost connections, none refused by the broker", returned, logged)
	}
	if cuts < int64(phases) {
		t.Errorf("outbox-connloss: %d staged publishes cut in %d phases: the scenario tested little", cuts, phases)
	}
}

// cutPublishType is the toxiproxy type of cutPublish.
const cutPublishType = "cut_publish"

// cutPublish is a toxic for a proxy's upstream (client to server) stream:
// when a chunk holds Match as an AMQP short string (the exchange or
// routing key of a basic.publish), it drops the chunk and closes the
// connection, both ways, Percent times in a hundred. A connection cut so
// loses the publish with the confirm outstanding: the client learns of it
// only from the connection's end.
type cutPublish struct {
	Match   string `json:"match"`
	Percent int    `json:"percent"`

	cuts atomic.Int64 // connections cut, over every link
}

// cutPublishState is one link's: the tail of the last chunk, for a match
// that spans two chunks.
type cutPublishState struct{ tail []byte }

// NewState is toxics.StatefulToxic's.
func (c *cutPublish) NewState() any { return new(cutPublishState) }

// Pipe is toxics.Toxic's.
func (c *cutPublish) Pipe(stub *toxics.ToxicStub) {
	state := stub.State.(*cutPublishState)
	needle := append([]byte{byte(len(c.Match))}, c.Match...)
	for {
		select {
		case <-stub.Interrupt:
			return
		case ch := <-stub.Input:
			if ch == nil {
				stub.Close()
				return
			}
			seen := append(append([]byte(nil), state.tail...), ch.Data...)
			if strings.Contains(string(seen), string(needle)) && rand.IntN(100) < c.Percent {
				c.cuts.Add(1)
				stub.Close()
				// Drop what the client still sends until it sees the
				// connection's end, so that the proxy's reader ends.
				for {
					select {
					case <-stub.Interrupt:
						return
					case ch := <-stub.Input:
						if ch == nil {
							return
						}
					}
				}
			}
			state.tail = append(state.tail[:0], seen[max(len(seen)-len(needle)+1, 0):]...)
			stub.Output <- ch
		}
	}
}
