package amqpidem

import (
	"crypto/sha256"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrNoKey means a message has no usable idempotency key. KeyFuncs return
// it, wrapped with the reason.
var ErrNoKey = errors.New("amqpidem: no idempotency key")

// ErrInvalidKey means a message's key cannot be used: longer than the store
// takes (lock.MaxKeyLen less the endpoint and one byte), or the KeyFunc or
// Config.Fingerprint panicked. Such a message is dead-lettered ("invalid key"), never run
// without a key, whatever Config.MissingKey says.
var ErrInvalidKey = errors.New("amqpidem: invalid idempotency key")

// KeyFunc extracts the idempotency key of a delivery. It returns an error
// wrapping ErrNoKey when there is none; Config.MissingKey decides what
// happens then. A KeyFunc that panics is recovered: ErrInvalidKey.
type KeyFunc func(d *amqp.Delivery) (string, error)

// MessageID is the default KeyFunc: the message-id property.
func MessageID(d *amqp.Delivery) (string, error) {
	if d.MessageId == "" {
		return "", fmt.Errorf("%w: message-id property is empty", ErrNoKey)
	}
	return d.MessageId, nil
}

// Header returns a KeyFunc that reads the key from header name. The value
// must be a non-empty string or byte slice; any other type is ErrNoKey,
// naming the type found (a number is refused rather than formatted, so
// that 1 and "1" cannot silently be the same operation).
func Header(name string) KeyFunc {
	return func(d *amqp.Delivery) (string, error) {
		v, ok := d.Headers[name]
		if !ok {
			return "", fmt.Errorf("%w: header %q is missing", ErrNoKey, name)
		}
		var key string
		switch v := v.(type) {
		case string:
			key = v
		case []byte:
			key = string(v)
		default:
			return "", fmt.Errorf("%w: header %q is a %T, want a string", ErrNoKey, name, v)
		}
		if key == "" {
			return "", fmt.Errorf("%w: header %q is empty", ErrNoKey, name)
		}
		return key, nil
	}
}

// BodyHash is a KeyFunc that uses the SHA-256 of the body: two messages with the same body are one operation. Use it
// only when that is true of your messages; it is never the default. An
// empty body has no key.
func BodyHash(d *amqp.Delivery) (string, error) {
	if len(d.Body) == 0 {
		return "", fmt.Errorf("%w: body is empty", ErrNoKey)
	}
	return "sha256:" + fingerprint(d.Body), nil
}

// fingerprint identifies a payload for the key-conflict check: the first
// 16 bytes of its SHA-256, in lower-case hex (as hex.EncodeToString
// writes them, into an array so that the only allocation is the string).
func fingerprint(body []byte) string {
	const digits = "0123456789abcdef"
	sum := sha256.Sum256(body)
	var buf [32]byte
	for i, b := range sum[:16] {
		buf[2*i], buf[2*i+1] = digits[b>>4], digits[b&0x0f]
	}
	return string(buf[:])
}
