// Package wire is the stored form of a message amqpidem is to publish
// later: the staged messages of a consumer's outbox (amqpidem.Stage) and
// the rows of pgstore's producer outbox. It holds an amqp.Publishing, its
// exchange and its routing key in the encoding of AMQP 0-9-1's
// basic.publish and content header, after a version byte.
//
// Guarantees:
//
//   - One message has one stored form: a property is present exactly when
//     amqp091-go would send it, and table keys are in byte order, so every
//     publish of a stored message sends the same message.
//   - ReadPublishing gives back what a consumer using amqp091-go receives
//     for the message (an int header as an int32, times in whole seconds),
//     shares no memory with its input, and allocates in proportion to its
//     input, whatever a forged length says.
//   - What ReadPublishing accepts re-encodes to the very bytes it read
//     (FuzzReadPublishing holds it to that); anything AppendPublishing
//     would not have written is refused with ErrBadStored, naming the
//     field and the byte offset.
//   - AppendPublishing refuses, with ErrBadPublishing naming the field,
//     what amqp091-go or the broker would refuse, so that a stored message
//     can always be published.
//
// Limits: short strings up to 255 bytes; tables and arrays nested at most
// 16 deep and holding at most 8,192 entries; long strings, byte arrays,
// tables and arrays up to 2^31-1 bytes. A change of the layout takes a new
// version number; this package reads version 1 only.
//
// The package is internal: users reach it through amqpidem.MarshalPublishing
// and amqpidem.UnmarshalPublishing, which pgstore uses too.
package wire
