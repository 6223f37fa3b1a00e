package lock

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// The Go side of the record format of scripts/record.lua: a MessagePack
// sequence of eleven values, as Lua's cmsgpack packs them (integers in the
// smallest form, strings as str). Only the native Acquire uses it: it
// writes a format 2 record for an absent key and reads the record a
// present key holds.

// record is a decoded record, in format 1 terms.
type record struct {
	state       string
	owner       string
	fence       int64
	deadline    int64 // ms, server clock; 0 when none
	attempts    int64
	fingerprint string
	key         string
	created     int64 // ms
	ended       int64 // ms
	value       string
}

// newRecord packs the format 2 record the native Acquire writes for an
// absent key: in progress, attempt 1, with the lease TTL and the PX it is
// written with (TTL + retention, keep) in place of the times the server
// fills in.
func newRecord(owner string, ttl, keep int64, fingerprint, key string) []byte {
	return appendRecord(make([]byte, 0, 40+len(owner)+len(fingerprint)+len(key)), owner, ttl, keep, fingerprint, key)
}

// appendRecord appends to b the record newRecord packs.
func appendRecord(b []byte, owner string, ttl, keep int64, fingerprint, key string) []byte {
	b = appendInt(b, 2)
	b = appendStr(b, "p")
	b = appendStr(b, owner)
	b = appendInt(b, 0)
	b = appendInt(b, ttl)
	b = appendInt(b, 1)
	b = appendStr(b, fingerprint)
	b = appendStr(b, key)
	b = appendInt(b, keep)
	b = appendInt(b, 0)
	return appendStr(b, "")
}

// appendHead appends to b the start of the format 1 record that a script
// writes for an outcome of a format 2 record: the fields up to and
// including created, packed as cmsgpack packs them (the deadline 0, the
// lease's owner, fence and attempts, the record's fingerprint and key);
// ended and the value follow, which finish.lua packs. It starts with
// what appendLeaseHead appends.
func appendHead(b []byte, state, owner string, fence, attempts int64, fingerprint, key string, created int64) []byte {
	b = appendLeaseHead(b, state, owner, fence)
	b = appendInt(b, 0)
	b = appendInt(b, attempts)
	b = appendStr(b, fingerprint)
	b = appendStr(b, key)
	return appendInt(b, created)
}

// appendLeaseHead appends to b the first four fields of the format 1
// record an outcome writes, as appendHead starts: version 1, the new
// state, the lease's owner and fence. finish.lua unpacks them to judge a
// record it decodes.
func appendLeaseHead(b []byte, state, owner string, fence int64) []byte {
	b = appendInt(b, 1)
	b = appendStr(b, state)
	b = appendStr(b, owner)
	return appendInt(b, fence)
}

// firstFence is the fence of a format 2 record whose key expires at
// expireAt (PEXPIRETIME, ms) after it was written with PX keep: the first
// µs after the millisecond it was made in, as record.lua computes it.
func firstFence(expireAt, keep int64) int64 {
	return (expireAt - keep + 1) * 1000
}

// decodeRecord reads a record of format 1 or 2; expireAt is the key's
// PEXPIRETIME, which a format 2 record needs.
func decodeRecord(raw string, expireAt int64) (record, error) {
	d := decoder{b: raw}
	version := d.int()
	r := record{
		state:       d.str(),
		owner:       d.str(),
		fence:       d.int(),
		deadline:    d.int(),
		attempts:    d.int(),
		fingerprint: d.str(),
		key:         d.str(),
		created:     d.int(),
		ended:       d.int(),
		value:       d.str(),
	}
	switch {
	case d.err != nil:
		return record{}, fmt.Errorf("record format: %w", d.err)
	case len(d.b) != 0:
		return record{}, errors.New("record format: bytes after the last field")
	case version == 2:
		if expireAt < 0 {
			return record{}, errors.New("record format version 2 without an expiry")
		}
		keep := r.created
		r.created = expireAt - keep
		r.deadline += r.created
		r.fence = firstFence(expireAt, keep)
	case version != 1:
		return record{}, fmt.Errorf("record format version %d unknown", version)
	}
	return r, nil
}

func appendInt(b []byte, n int64) []byte {
	switch {
	case n >= 0 && n <= 0x7f:
		return append(b, byte(n))
	case n >= -32 && n < 0:
		return append(b, byte(n))
	case n >= 0 && n <= math.MaxUint8:
		return append(b, 0xcc, byte(n))
	case n >= 0 && n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(n))
	case n >= 0 && n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(n))
	case n >= 0:
		return binary.BigEndian.AppendUint64(append(b, 0xcf), uint64(n))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(n))
}

func appendStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
	}
	return append(b, s...)
}

// decoder reads MessagePack integers and strings off b; the first error
// sticks.
type decoder struct {
	b   string
	err error
}

func (d *decoder) take(n int) string {
	if d.err != nil {
		return ""
	}
	if n < 0 || n > len(d.b) {
		d.err = errors.New("truncated")
		return ""
	}
	s := d.b[:n]
	d.b = d.b[n:]
	return s
}

func (d *decoder) uint(n int) uint64 {
	var v uint64
	for _, c := range []byte(d.take(n)) {
		v = v<<8 | uint64(c)
	}
	return v
}

func (d *decoder) int() int64 {
	t := d.take(1)
	if t == "" {
		return 0
	}
	switch c := t[0]; {
	case c <= 0x7f:
		return int64(c)
	case c >= 0xe0:
		return int64(int8(c))
	case c >= 0xcc && c <= 0xcf:
		return int64(d.uint(1 << (c - 0xcc)))
	case c >= 0xd0 && c <= 0xd3:
		n := 1 << (c - 0xd0)
		v := d.uint(n)
		shift := 64 - 8*n
		return int64(v<<shift) >> shift
	case c == 0xcb:
		// cmsgpack packs a number that is not an integer as a double.
		f := math.Float64frombits(d.uint(8))
		if f != math.Trunc(f) || math.Abs(f) > 1<<53 {
			d.fail("a fraction where an integer belongs")
		}
		return int64(f)
	}
	d.fail(fmt.Sprintf("type byte 0x%02x where an integer belongs", t[0]))
	return 0
}

func (d *decoder) str() string {
	t := d.take(1)
	if t == "" {
		return ""
	}
	switch c := t[0]; {
	case c >= 0xa0 && c <= 0xbf:
		return d.take(int(c & 0x1f))
	case c == 0xd9:
		return d.take(int(d.uint(1)))
	case c == 0xda:
		return d.take(int(d.uint(2)))
	case c == 0xdb:
		return d.take(int(d.uint(4)))
	}
	d.fail(fmt.Sprintf("type byte 0x%02x where a string belongs", t[0]))
	return ""
}

func (d *decoder) fail(msg string) {
	if d.err == nil {
		d.err = errors.New(msg)
	}
}
