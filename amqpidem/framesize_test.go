package amqpidem

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/wire/wiretest"
)

// headerFrameSize is the size the broker checks against frame_max: a
// message computed to fill frame_max exactly is taken, the publisher's
// own check refuses one a byte larger before sending it (ErrTooLarge),
// and the broker refuses (closing the connection) one just past its own
// slack.
func TestHeaderFrameSizeAtTheLimit(t *testing.T) {
	url := testenv.AMQPURL(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fm := conn.Config.FrameSize
	if fm <= 0 {
		t.Skipf("no frame_max negotiated (%d)", fm)
	}
	queue := testenv.Name(t)
	testenv.QueueChannel(t, queue)
	at := func(size int) amqp.Publishing {
		msg := amqp.Publishing{MessageId: "m", Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
			Headers: amqp.Table{"n": int64(1), "t": time.Now(), "a": []any{"x", int32(2)}, "big": ""}}
		msg.Headers["big"] = strings.Repeat("b", size-headerFrameSize(&msg))
		if got := headerFrameSize(&msg); got != size {
			t.Fatalf("built %d bytes, want %d", got, size)
		}
		return msg
	}
	raw := func(msg amqp.Publishing) (bool, error) {
		c, err := conn.Channel()
		if err != nil {
			return false, err
		}
		defer c.Close()
		if err := c.Confirm(false); err != nil {
			return false, err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		dc, err := c.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, msg)
		if err != nil {
			return false, err
		}
		return dc.WaitContext(ctx)
	}
	if ok, err := raw(at(fm)); !ok || err != nil {
		t.Fatalf("a header frame of exactly frame_max %d: acked %v, %v", fm, ok, err)
	}
	p := newPublisher(conn, queueClassic)
	defer p.close()
	if err := p.publish(context.Background(), "", queue, at(fm)); err != nil {
		t.Fatalf("publisher at frame_max: %v", err)
	}
	err = p.publish(context.Background(), "", queue, at(fm+1))
	if !errors.Is(err, ErrTooLarge) || !IsRefused(err) {
		t.Fatalf("publisher at frame_max+1: %v, want ErrTooLarge, refused", err)
	}
	// Last: the broker answers with a connection error (501 FRAME_ERROR).
	// RabbitMQ takes up to frameOverhead bytes more than the spec's
	// frame_max (measured on 3.10: frame_max+8 taken, +9 refused), so the
	// check is at most that much stricter than the broker, never looser.
	if ok, err := raw(at(fm + frameOverhead + 1)); ok {
		t.Fatalf("a header frame of frame_max+%d was taken: the size computed is short (%v)", frameOverhead+1, err)
	}
}

// fitHeaders drops the largest headers first, never those it is told to
// keep, until the copy fits, and names those it dropped.
func TestFitHeaders(t *testing.T) {
	msg := amqp.Publishing{MessageId: "m", Headers: amqp.Table{
		"huge": strings.Repeat("h", 9000), "big": strings.Repeat("b", 3000),
		"small": "s", HeaderReason: "permanent failure", HeaderKey: strings.Repeat("k", 2000),
	}}
	orig := msg.Headers
	note := fitHeaders(&msg, amqp.Table{HeaderReason: nil, HeaderKey: nil}, 8192)
	if headerFrameSize(&msg) > 8192 {
		t.Fatalf("still %d bytes", headerFrameSize(&msg))
	}
	if _, ok := msg.Headers["huge"]; ok {
		t.Error("kept the largest header")
	}
	for _, k := range []string{"big", "small", HeaderReason, HeaderKey} {
		if _, ok := msg.Headers[k]; !ok {
			t.Errorf("dropped %s, which fitted", k)
		}
	}
	if msg.Headers[HeaderHeadersDropped] != note || !strings.Contains(note, "huge") || strings.Contains(note, "big") {
		t.Errorf("note %q", note)
	}
	if _, ok := orig["huge"]; !ok {
		t.Error("changed the table it was given")
	}
	if note := fitHeaders(&msg, nil, 8192); note != "" {
		t.Errorf("a copy that fits: note %q", note)
	}
	if note := fitHeaders(&msg, nil, 0); note != "" {
		t.Errorf("no frame_max: note %q", note)
	}
}

// FuzzHeaderFrameSize: for any message the outbox codec can hold (read
// from arbitrary bytes), headerFrameSize is the size of the content header
// the codec writes, which is the one amqp091-go sends (internal/wire's FuzzReadPublishing
// holds the codec to it): the codec's form is the header's body-size,
// flags and properties, after a version byte and two empty short strings,
// where the frame has its overhead, class and weight.
func FuzzHeaderFrameSize(f *testing.F) {
	for _, m := range []amqp.Publishing{{}, wiretest.Every, wiretest.Hdr("n", wiretest.Nested(amqp.Table{"a": []any{nil}}, 7, true))} {
		b, err := appendPublishing(nil, "", "", m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, v := range wiretest.EveryHeaders {
		b, err := appendPublishing(nil, "", "", wiretest.Hdr("v", v))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _, msg, _, err := readPublishing(b)
		if err != nil {
			return
		}
		msg.Body = nil
		enc, err := appendPublishing(nil, "", "", msg)
		if err != nil {
			t.Fatalf("re-encoding what was read: %v", err)
		}
		if want := frameOverhead + 2 + 2 + len(enc) - 3; headerFrameSize(&msg) != want {
			t.Fatalf("headerFrameSize = %d, the codec's content header %d; msg %+v", headerFrameSize(&msg), want, msg)
		}
	})
}
