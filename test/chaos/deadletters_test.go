package chaos_test

import (
	"reflect"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// TestFirstDeadLetters checks how scenarios 13 and 14 tell the dead
// letters that report a failure from those made again from the record of
// an operation that already failed: only two dead letters from two
// executions count twice.
func TestFirstDeadLetters(t *testing.T) {
	dl := func(op, reason, text string) deadLetter {
		return deadLetter{Op: op, D: amqp.Delivery{Headers: amqp.Table{amqpidem.HeaderReason: reason, amqpidem.HeaderError: text}}}
	}
	dls := []deadLetter{
		// once, as the handler failed
		dl("once", "permanent failure", "card declined"),
		// its ack lost: dead-lettered again as a failed duplicate
		dl("ack-lost", "permanent failure", "card declined"),
		dl("ack-lost", "failed duplicate", "permanent failure: card declined"),
		// its dead letter's confirm lost: dead-lettered again, pending,
		// with the reason and error text the record gives
		dl("confirm-lost", "permanent failure", "card declined"),
		dl("confirm-lost", "permanent failure", "permanent failure: card declined"),
		// only the one made from the record arrived
		dl("first-lost", "attempts exhausted", "attempts exhausted: timeout"),
		// two executions, two failures: a duplicate
		dl("twice", "permanent failure", "card declined"),
		dl("twice", "permanent failure", "card declined"),
	}
	counted, redundant := firstDeadLetters(dls)
	want := map[string]int{"once": 1, "ack-lost": 1, "confirm-lost": 1, "first-lost": 1, "twice": 2}
	if !reflect.DeepEqual(counted, want) || redundant != 2 {
		t.Fatalf("counted %v, redundant %d; want %v, 2", counted, redundant, want)
	}
}
