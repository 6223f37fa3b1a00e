package amqpidem

import (
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/wire"
)

// The stored form of a message to publish, the one the outbox keeps in a
// record, is internal/wire's; these names keep this package's code and
// tests as they were before the codec moved there (issue 41).

// appendPublishing appends to b the stored form of a message to publish to
// exchange with routing key key (wire.AppendPublishing).
func appendPublishing(b []byte, exchange, key string, msg amqp.Publishing) ([]byte, error) {
	return wire.AppendPublishing(b, exchange, key, msg)
}

// readPublishing reads one stored message from the front of b and returns
// it and the bytes after it (wire.ReadPublishing).
func readPublishing(b []byte) (exchange, key string, msg amqp.Publishing, rest []byte, err error) {
	return wire.ReadPublishing(b)
}

// MarshalPublishing returns the stored form of msg, to be published to
// exchange with routing key key: the one amqpidem's outboxes keep (the
// staged messages of a record, pgstore's producer outbox), versioned and
// close to AMQP's own encoding, so that every publish of it sends the same
// message. It refuses, with the field and the reason, what amqp091-go or
// the broker would refuse (see amqp.Table.Validate).
func MarshalPublishing(exchange, key string, msg amqp.Publishing) ([]byte, error) {
	return wire.Marshal(exchange, key, msg)
}

// UnmarshalPublishing reads what MarshalPublishing wrote. It refuses, with
// the field, the byte offset and the reason, bytes that are not exactly
// one stored message: truncated, damaged, followed by more bytes, or
// written by another version.
func UnmarshalPublishing(b []byte) (exchange, key string, msg amqp.Publishing, err error) {
	return wire.Unmarshal(b)
}
