package amqpidem

import (
	"context"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// TestPublisherWaitWokenByPut takes all the room a publisher has (every
// channel it may open, full), so that one more get waits; a put then
// gives it the room, and a get that waits again after that is woken by
// the next put too. The publisher replaces its changed channel only when
// a get waits on it: a put that skipped a waiting get would leave it
// waiting until its context ended.
func TestPublisherWaitWokenByPut(t *testing.T) {
	conn, err := amqp.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	p := newPublisher(conn, "classic")
	defer func() {
		p.close()
		p.wait()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type taken struct {
		pc *pubChannel
		w  *pubWait
	}
	var held []taken
	for i := range maxPubChannels * pubPerChannel {
		pc, w, err := p.get(ctx, "m-"+strconv.Itoa(i), false)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, taken{pc, w})
	}
	for round := range 2 {
		got := make(chan error, 1)
		go func() {
			pc, w, err := p.get(ctx, "extra-"+strconv.Itoa(round), false)
			if err == nil {
				held = append(held, taken{pc, w})
			}
			got <- err
		}()
		select {
		case err := <-got:
			t.Fatalf("round %d: a get found room on a full publisher: %v", round, err)
		case <-time.After(200 * time.Millisecond):
		}
		h := held[0]
		held = held[1:]
		p.put(h.pc, h.w, true)
		select {
		case err := <-got:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: the waiting get was not woken by a put", round)
		}
	}
	for _, h := range held {
		p.put(h.pc, h.w, true)
	}
}
