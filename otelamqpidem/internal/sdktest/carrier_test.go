package sdktest_test

import (
	"context"
	"slices"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/amqpidem/amqpidem/otelamqpidem"
)

func TestHeaderCarrierGet(t *testing.T) {
	c := otelamqpidem.HeaderCarrier{
		"text":   "a",
		"bytes":  []byte("b"),
		"number": int64(7),
		"nil":    nil,
	}
	for _, tc := range []struct{ key, want string }{
		{"text", "a"},
		{"bytes", "b"},
		{"number", ""},
		{"nil", ""},
		{"missing", ""},
		{"TEXT", ""}, // AMQP header names are case-sensitive
	} {
		if got := c.Get(tc.key); got != tc.want {
			t.Errorf("Get(%q): got %q, want %q", tc.key, got, tc.want)
		}
	}
	if got, want := otelamqpidem.HeaderCarrier(nil).Get("x"), ""; got != want {
		t.Errorf("Get on nil: got %q, want %q", got, want)
	}
}

func TestHeaderCarrierSetKeys(t *testing.T) {
	h := amqp.Table{"tenant": "acme"}
	c := otelamqpidem.HeaderCarrier(h)
	c.Set("traceparent", "00-x")
	if v, ok := h["traceparent"].(string); !ok || v != "00-x" {
		t.Fatalf("Set: header holds %#v, want the string %q", h["traceparent"], "00-x")
	}
	keys := c.Keys()
	slices.Sort(keys)
	if got, want := keys, []string{"tenant", "traceparent"}; !slices.Equal(got, want) {
		t.Fatalf("Keys: got %v, want %v", got, want)
	}
	if got := len(otelamqpidem.HeaderCarrier(nil).Keys()); got != 0 {
		t.Fatalf("Keys on nil: got %d keys, want 0", got)
	}
}

var (
	traceID = trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
	spanID  = trace.SpanID{1, 2, 3, 4, 5, 6, 7, 8}
)

// producerContext is a context holding a sampled remote span context, as a
// producer's span would be.
func producerContext() context.Context {
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled})
	return trace.ContextWithSpanContext(context.Background(), sc)
}

func TestInjectExtract(t *testing.T) {
	prop := otelamqpidem.WithPropagators(propagation.TraceContext{})
	h := amqp.Table{}
	otelamqpidem.Inject(producerContext(), h, prop)
	if got, want := h["traceparent"], "00-0102030405060708090a0b0c0d0e0f10-0102030405060708-01"; got != want {
		t.Fatalf("traceparent: got %#v, want %q", got, want)
	}

	// A header read back as a byte array, as some clients send text.
	h["traceparent"] = []byte(h["traceparent"].(string))
	sc := trace.SpanContextFromContext(otelamqpidem.Extract(context.Background(), h, prop))
	if got, want := sc.TraceID(), traceID; got != want {
		t.Fatalf("extracted trace id: got %v, want %v", got, want)
	}
	if got, want := sc.SpanID(), spanID; got != want {
		t.Fatalf("extracted span id: got %v, want %v", got, want)
	}
	if !sc.IsRemote() {
		t.Fatal("extracted span context is not remote")
	}

	// Nothing to write into: no panic, nothing done.
	otelamqpidem.Inject(producerContext(), nil, prop)

	// No trace headers: ctx comes back as it was.
	ctx := otelamqpidem.Extract(context.Background(), amqp.Table{"tenant": "acme"}, prop)
	if trace.SpanContextFromContext(ctx).IsValid() {
		t.Fatal("Extract without trace headers made a span context")
	}
}
