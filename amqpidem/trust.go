package amqpidem

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
)

// HeaderSignature is set on every copy a consumer with Config.SigningKey
// publishes (dead letters, requeued copies): an HMAC-SHA256, under that
// key, of the headers an operator's tool acts on (HeaderEndpoint,
// HeaderKey, HeaderOriginalExchange, HeaderOriginalRoutingKey) and of the
// body. VerifySignature checks it. A publisher can copy the header but not
// make one for other values without the key.
const HeaderSignature = "x-amqpidem-signature"

// MinSigningKey is the shortest Config.SigningKey Validate accepts, in
// bytes.
const MinSigningKey = 16

// signatureVersion prefixes HeaderSignature's value; the MAC follows in
// unpadded base64.
const signatureVersion = "v1:"

// signed are the headers HeaderSignature covers, in the order they are
// written into the MAC.
var signed = [...]string{HeaderEndpoint, HeaderKey, HeaderOriginalExchange, HeaderOriginalRoutingKey}

// ErrUnsigned is returned by VerifySignature for headers without
// HeaderSignature: a message amqpidem did not publish, or published
// without Config.SigningKey.
var ErrUnsigned = errors.New("amqpidem: headers not signed")

// ErrBadSignature is returned by VerifySignature when HeaderSignature does
// not match the headers and body under the key: they were changed or
// forged, or signed with another key.
var ErrBadSignature = errors.New("amqpidem: signature does not match")

// VerifySignature reports whether headers and body carry a HeaderSignature
// made with key: nil if so, else ErrUnsigned or ErrBadSignature. A nil
// error proves that a consumer holding key wrote the signed headers for
// this body, not that the message is recent or that it was dead-lettered
// rather than requeued.
func VerifySignature(key []byte, headers amqp.Table, body []byte) error {
	v, ok := headers[HeaderSignature].(string)
	if !ok {
		if _, present := headers[HeaderSignature]; present {
			return ErrBadSignature
		}
		return ErrUnsigned
	}
	if len(key) == 0 || !hmac.Equal([]byte(v), []byte(signature(key, headers, body))) {
		return ErrBadSignature
	}
	return nil
}

// signature is HeaderSignature's value for headers and body under key.
func signature(key []byte, headers amqp.Table, body []byte) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("amqpidem signature 1\x00"))
	for _, name := range signed {
		v, ok := signedText(headers[name])
		if !ok {
			m.Write([]byte{0}) // absent, or not text
			continue
		}
		m.Write([]byte{1})
		writeLen(m, len(v))
		m.Write([]byte(v))
	}
	writeLen(m, len(body))
	m.Write(body)
	return signatureVersion + base64.RawStdEncoding.EncodeToString(m.Sum(nil))
}

// signedText is a signed header's value when it is text.
func signedText(v any) (string, bool) {
	switch v := v.(type) {
	case string:
		return v, true
	case []byte:
		return string(v), true
	}
	return "", false
}

func writeLen(h hash.Hash, n int) {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(n))
	h.Write(b[:])
}

// sign sets msg's HeaderSignature under the consumer's SigningKey, if it
// has one. It must be the last change to the signed headers and the body.
func (p *processor) sign(msg *amqp.Publishing) {
	if len(p.cfg.SigningKey) == 0 {
		delete(msg.Headers, HeaderSignature) // copied from the delivery: it would not match
		return
	}
	msg.Headers[HeaderSignature] = signature(p.cfg.SigningKey, msg.Headers, msg.Body)
}

// parseHeaders reads d's headers (the package's parseHeaders) for this
// consumer. With a SigningKey, the original exchange and routing key in
// them are kept only when d's signature verifies: otherwise they may be a
// publisher's, and a copy names d's own exchange and routing key instead.
func (p *processor) parseHeaders(d *amqp.Delivery) headers {
	h := parseHeaders(d.Headers, p.cfg.MaxAttempts)
	if h.origin && len(p.cfg.SigningKey) > 0 && VerifySignature(p.cfg.SigningKey, d.Headers, d.Body) != nil {
		h.origin, h.exchange, h.routingKey = false, "", ""
	}
	return h
}

// replyRefused says why replyTo, a delivery's ReplyTo, is not one that
// Config.ReplyTo allows; nil when it is, when it is empty, or when
// Config.ReplyTo is not set.
func (p *processor) replyRefused(replyTo string) error {
	if replyTo == "" || len(p.cfg.ReplyTo) == 0 {
		return nil
	}
	for _, r := range p.cfg.ReplyTo {
		if prefix, ok := strings.CutSuffix(r, "*"); ok && strings.HasPrefix(replyTo, prefix) || r == replyTo {
			return nil
		}
	}
	return fmt.Errorf("amqpidem: reply-to %q is not in Config.ReplyTo", headerText(replyTo))
}
