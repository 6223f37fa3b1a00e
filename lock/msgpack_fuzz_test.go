package lock

import (
	"context"
	"encoding/binary"
	"math"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// The tests here read records with decodeRecord and write them with a
// second encoder, packRecord, written from cmsgpack's rules rather than
// from msgpack.go; TestRecordPackIsCmsgpack checks it against the
// cmsgpack.pack of a real Redis, so that "format 1 as the scripts write
// it" means what the scripts write.

// packInt appends n as Redis's cmsgpack packs an integral Lua number: the
// smallest of positive fixint, uint 8, 16, 32, 64 for n >= 0, and of
// negative fixint, int 8, 16, 32, 64 below 0.
func packInt(b []byte, n int64) []byte {
	switch {
	case n >= 0 && n <= 0x7f:
		return append(b, byte(n))
	case n >= 0 && n <= 0xff:
		return intAs(b, 0xcc, n)
	case n >= 0 && n <= 0xffff:
		return intAs(b, 0xcd, n)
	case n >= 0 && n <= 0xffffffff:
		return intAs(b, 0xce, n)
	case n >= 0:
		return intAs(b, 0xcf, n)
	case n >= -32:
		return append(b, byte(n))
	case n >= math.MinInt8:
		return intAs(b, 0xd0, n)
	case n >= math.MinInt16:
		return intAs(b, 0xd1, n)
	case n >= math.MinInt32:
		return intAs(b, 0xd2, n)
	}
	return intAs(b, 0xd3, n)
}

// intAs appends n in the integer type tag (0xcc-0xcf, 0xd0-0xd3), cut to
// that type's width whether or not it fits.
func intAs(b []byte, tag byte, n int64) []byte {
	width := 1 << (tag & 3)
	b = append(b, tag)
	for i := width - 1; i >= 0; i-- {
		b = append(b, byte(uint64(n)>>(8*i)))
	}
	return b
}

// doubleAs appends f as a MessagePack float 64 (0xcb).
func doubleAs(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(f))
}

// packStr appends s as cmsgpack packs a Lua string: fixstr below 32
// bytes, then str 8, 16, 32 (0xd9, 0xda, 0xdb), the smallest that holds it.
func packStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		return append(append(b, 0xa0|byte(n)), s...)
	case n <= 0xff:
		return strAs(b, 0xd9, s)
	case n <= 0xffff:
		return strAs(b, 0xda, s)
	}
	return strAs(b, 0xdb, s)
}

// strAs appends s as a str 8, 16 or 32 (tag 0xd9, 0xda, 0xdb), whatever
// its length.
func strAs(b []byte, tag byte, s string) []byte {
	width := 1 << (tag - 0xd9)
	b = append(b, tag)
	for i := width - 1; i >= 0; i-- {
		b = append(b, byte(len(s)>>(8*i)))
	}
	return append(b, s...)
}

// recordParts packs version and r field by field, as record.lua's put
// packs cmsgpack.pack(1, state, owner, ...): eleven values, version first.
func recordParts(version int64, r record) [][]byte {
	return [][]byte{
		packInt(nil, version),
		packStr(nil, r.state),
		packStr(nil, r.owner),
		packInt(nil, r.fence),
		packInt(nil, r.deadline),
		packInt(nil, r.attempts),
		packStr(nil, r.fingerprint),
		packStr(nil, r.key),
		packInt(nil, r.created),
		packInt(nil, r.ended),
		packStr(nil, r.value),
	}
}

// packRecord is the record recordParts packs, in one piece.
func packRecord(version int64, r record) []byte {
	var b []byte
	for _, p := range recordParts(version, r) {
		b = append(b, p...)
	}
	return b
}

// withPart is the record of parts with part i replaced by p.
func withPart(parts [][]byte, i int, p []byte) []byte {
	var b []byte
	for j, q := range parts {
		if j == i {
			q = p
		}
		b = append(b, q...)
	}
	return b
}

// A completed record as the scripts leave it, with times of 2027.
var sampleRecord = record{state: "c", owner: "0123456789abcdef0123456789abcdef", fence: 1_800_000_000_000_001,
	attempts: 2, fingerprint: "fp", key: "order-42", created: 1_800_000_000_000, ended: 1_800_000_000_500, value: "done"}

// The expiry of sampleRecord's key, as PEXPIRETIME gives it.
const sampleExpireAt = 1_800_000_000_000 + 30_000 + 86_400_000

// What cmsgpack.pack writes for records of every integer width, negative
// widths included, and every string length class is what packRecord
// writes, and decodeRecord reads it back as written. Lua numbers are
// doubles, so the integers stay within ±2^53.
func TestRecordPackIsCmsgpack(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	const pack = `local a = ARGV
		return cmsgpack.pack(tonumber(a[1]), a[2], a[3], tonumber(a[4]), tonumber(a[5]), tonumber(a[6]),
			a[7], a[8], tonumber(a[9]), tonumber(a[10]), a[11])`
	check := func(version int64, r record) {
		t.Helper()
		args := []any{version, r.state, r.owner, r.fence, r.deadline, r.attempts, r.fingerprint, r.key, r.created, r.ended, r.value}
		for i, a := range args {
			if n, ok := a.(int64); ok {
				args[i] = strconv.FormatInt(n, 10)
			}
		}
		got, err := client.Eval(ctx, pack, nil, args...).Text()
		if err != nil {
			t.Fatal(err)
		}
		if want := string(packRecord(version, r)); got != want {
			t.Fatalf("%+v: cmsgpack.pack wrote %x, packRecord %x", r, got, want)
		}
		if version == 1 {
			if d, err := decodeRecord(got, -1); err != nil || d != r {
				t.Fatalf("cmsgpack's %x decoded to %+v, %v; want %+v", got, d, err, r)
			}
		}
	}
	for _, n := range []int64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1 << 53,
		-1, -32, -33, -128, -129, -32768, -32769, -1 << 31, -1<<31 - 1, -1 << 53} {
		r := sampleRecord
		r.fence, r.deadline, r.attempts, r.created, r.ended = n, -n, n/2, n/3, -n/2
		check(1, r)
		check(n, r)
	}
	for _, n := range []int{0, 1, 31, 32, 255, 256, 65535, 65536, 70000} {
		r := sampleRecord
		r.owner, r.value = strings.Repeat("o", n), strings.Repeat("\xff", n)
		check(1, r)
	}
}

// The integer encodings the decoder takes, and those it refuses: every
// MessagePack integer type, canonical or not, and doubles only where they
// hold an integer that a Lua number holds exactly.
func TestRecordIntegerEncodings(t *testing.T) {
	for _, c := range []struct {
		name string
		enc  []byte
		want int64
		ok   bool
	}{
		{"fixint", []byte{0x7f}, 127, true},
		{"negative fixint", []byte{0xe0}, -32, true},
		{"uint 8", intAs(nil, 0xcc, 200), 200, true},
		{"uint 8 holding a fixint", intAs(nil, 0xcc, 5), 5, true},
		{"uint 16", intAs(nil, 0xcd, 40000), 40000, true},
		{"uint 32", intAs(nil, 0xce, 3_000_000_000), 3_000_000_000, true},
		{"uint 64", intAs(nil, 0xcf, 1_800_000_000_000_001), 1_800_000_000_000_001, true},
		{"uint 64 above int64", intAs(nil, 0xcf, -2), -2, true},
		{"int 8", intAs(nil, 0xd0, -100), -100, true},
		{"int 16", intAs(nil, 0xd1, -30000), -30000, true},
		{"int 32", intAs(nil, 0xd2, -2_000_000_000), -2_000_000_000, true},
		{"int 64", intAs(nil, 0xd3, -1<<40), -1 << 40, true},
		{"int 64 holding a positive", intAs(nil, 0xd3, 1<<40), 1 << 40, true},
		{"integral double", doubleAs(nil, 12345), 12345, true},
		{"negative integral double", doubleAs(nil, -7), -7, true},
		{"negative zero", doubleAs(nil, math.Copysign(0, -1)), 0, true},
		{"double 2^53", doubleAs(nil, 1<<53), 1 << 53, true},
		{"double above 2^53", doubleAs(nil, 1<<53+2), 0, false},
		{"fraction", doubleAs(nil, 0.5), 0, false},
		{"NaN", doubleAs(nil, math.NaN()), 0, false},
		{"infinity", doubleAs(nil, math.Inf(-1)), 0, false},
		{"float 32", []byte{0xca, 0x3f, 0x80, 0, 0}, 0, false},
		{"nil", []byte{0xc0}, 0, false},
		{"true", []byte{0xc3}, 0, false},
		{"fixstr", []byte{0xa1, '1'}, 0, false},
		{"uint 32 cut short", []byte{0xce, 0, 0}, 0, false},
		{"int 64 cut short", []byte{0xd3, 0, 0, 0, 0, 0, 0, 0}, 0, false},
		{"double cut short", []byte{0xcb, 0x40}, 0, false},
		{"nothing", nil, 0, false},
	} {
		raw := withPart(recordParts(1, sampleRecord), 3, c.enc)
		r, err := decodeRecord(string(raw), -1)
		switch {
		case !c.ok && err == nil:
			t.Errorf("%s %x: decoded fence %d, want an error", c.name, c.enc, r.fence)
		case c.ok && err != nil:
			t.Errorf("%s %x: %v", c.name, c.enc, err)
		case c.ok && r.fence != c.want:
			t.Errorf("%s %x: got %d, want %d", c.name, c.enc, r.fence, c.want)
		}
	}
}

// The string encodings the decoder takes, and those it refuses: every
// MessagePack str type, canonical or not, never a length beyond the input.
func TestRecordStringEncodings(t *testing.T) {
	for _, c := range []struct {
		name string
		enc  []byte
		want string
		ok   bool
	}{
		{"empty fixstr", []byte{0xa0}, "", true},
		{"fixstr", []byte{0xa3, 'a', 'b', 'c'}, "abc", true},
		{"str 8", strAs(nil, 0xd9, "abc"), "abc", true},
		{"str 16", strAs(nil, 0xda, "abc"), "abc", true},
		{"str 32", strAs(nil, 0xdb, "abc"), "abc", true},
		{"str 32 empty", strAs(nil, 0xdb, ""), "", true},
		{"not UTF-8", []byte{0xa2, 0xff, 0x00}, "\xff\x00", true},
		{"fixstr cut short", []byte{0xa5, 'a'}, "", false},
		{"str 8 past the end", []byte{0xd9, 0xff, 'a'}, "", false},
		{"str 16 past the end", []byte{0xda, 0xff, 0xff, 'a'}, "", false},
		{"str 32 past the end", []byte{0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}, "", false},
		{"str 32 above int32", []byte{0xdb, 0x80, 0, 0, 0, 'a'}, "", false},
		{"str 16 length cut short", []byte{0xda, 0x01}, "", false},
		{"bin 8", []byte{0xc4, 0x01, 'a'}, "", false},
		{"integer", []byte{0x01}, "", false},
		{"nil", []byte{0xc0}, "", false},
	} {
		raw := withPart(recordParts(1, sampleRecord), 10, c.enc)
		r, err := decodeRecord(string(raw), -1)
		switch {
		case !c.ok && err == nil:
			t.Errorf("%s %x: decoded value %q, want an error", c.name, c.enc, r.value)
		case c.ok && err != nil:
			t.Errorf("%s %x: %v", c.name, c.enc, err)
		case c.ok && r.value != c.want:
			t.Errorf("%s %x: got %q, want %q", c.name, c.enc, r.value, c.want)
		}
	}
}

// A string that claims 4 GiB in a record of a few bytes is an error, and
// reading it allocates nothing like its claimed length.
func TestRecordHugeStringClaim(t *testing.T) {
	raw := string(withPart(recordParts(1, sampleRecord), 2, []byte{0xdb, 0xff, 0xff, 0xff, 0xff, 'o'}))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 100 {
		if _, err := decodeRecord(raw, -1); err == nil || !strings.Contains(err.Error(), "truncated") {
			t.Fatalf("owner of 4 GiB in %d bytes: got %v, want truncated", len(raw), err)
		}
	}
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Fatalf("100 decodes of a 4 GiB claim allocated %d bytes", got)
	}
}

// decodeSeeds are FuzzDecodeRecord's seed corpus: format 1 and format 2
// records, every integer and string encoding in the fields, unknown and
// oddly encoded versions, truncated records, trailing bytes, and key
// expiries of every sign.
func decodeSeeds() []struct {
	raw      []byte
	expireAt int64
} {
	type seed = struct {
		raw      []byte
		expireAt int64
	}
	var seeds []seed
	add := func(raw []byte, expireAt ...int64) {
		for _, e := range expireAt {
			seeds = append(seeds, seed{raw, e})
		}
	}
	parts := recordParts(1, sampleRecord)
	v1 := packRecord(1, sampleRecord)
	add(v1, sampleExpireAt, -1)
	for _, state := range []string{"p", "c", "f", "r", "x", "d"} {
		r := sampleRecord
		r.state = state
		add(packRecord(1, r), sampleExpireAt)
	}
	add(packRecord(1, record{state: "d", fence: 1_800_000_000_000_001, key: "order-42"}), sampleExpireAt) // forget.lua's tombstone
	add(packRecord(1, record{}), 0)

	const ttl, keep = 30_000, 30_000 + 86_400_000
	v2 := newRecord("0123456789abcdef0123456789abcdef", ttl, keep, "fp", "order-42")
	add(v2, sampleExpireAt, keep, 0, -1, -2, math.MaxInt64, math.MinInt64)
	add(newRecord("", 1, 2, "", ""), 2, 1)

	// Integers in every encoding, in the fence (for format 1) and in the
	// created time (for format 2, where it is the PX).
	ints := [][]byte{
		{0x00}, {0x7f}, {0xe0}, {0xff},
		intAs(nil, 0xcc, 200), intAs(nil, 0xcc, 5), intAs(nil, 0xcd, 40000), intAs(nil, 0xce, 3_000_000_000),
		intAs(nil, 0xcf, 1_800_000_000_000_001), intAs(nil, 0xcf, -1),
		intAs(nil, 0xd0, -100), intAs(nil, 0xd1, -30000), intAs(nil, 0xd2, -2_000_000_000),
		intAs(nil, 0xd3, -1<<40), intAs(nil, 0xd3, 5), intAs(nil, 0xd3, math.MinInt64),
		doubleAs(nil, 12345), doubleAs(nil, -7), doubleAs(nil, 0.5), doubleAs(nil, math.Copysign(0, -1)),
		doubleAs(nil, math.NaN()), doubleAs(nil, math.Inf(1)), doubleAs(nil, 1<<53), doubleAs(nil, 1<<53+2), doubleAs(nil, 1e300),
		{0xca, 0x3f, 0x80, 0, 0}, {0xc0}, {0xc2},
	}
	parts2 := recordParts(2, record{state: "p", owner: "o", deadline: ttl, attempts: 1, key: "k", created: keep})
	for _, p := range ints {
		add(withPart(parts, 3, p), sampleExpireAt)
		add(withPart(parts2, 8, p), sampleExpireAt)
	}
	// Versions: known ones in other encodings, unknown ones.
	for _, p := range [][]byte{
		intAs(nil, 0xcc, 1), intAs(nil, 0xd3, 2), doubleAs(nil, 1), doubleAs(nil, 2), doubleAs(nil, 1.5),
		{0x00}, {0x03}, {0x7f}, {0xff}, intAs(nil, 0xcf, math.MaxInt64), {0xa1, '1'}, {0xc0},
	} {
		add(withPart(parts, 0, p), sampleExpireAt)
		add(withPart(parts2, 0, p), sampleExpireAt, -1)
	}
	// Strings of each length class, canonical or not, and lengths beyond
	// the input, in the owner.
	for _, p := range [][]byte{
		packStr(nil, ""), packStr(nil, strings.Repeat("o", 31)), packStr(nil, strings.Repeat("o", 32)),
		packStr(nil, strings.Repeat("o", 255)), packStr(nil, strings.Repeat("o", 256)),
		strAs(nil, 0xd9, "o"), strAs(nil, 0xda, "o"), strAs(nil, 0xdb, "o"), strAs(nil, 0xdb, ""),
		{0xa5, 'o'}, {0xd9, 0xff, 'o'}, {0xda, 0xff, 0xff, 'o'}, {0xdb, 0xff, 0xff, 0xff, 0xff, 'o'},
		{0xdb, 0x80, 0, 0, 0}, {0xc4, 0x01, 'o'}, {0x01},
	} {
		add(withPart(parts, 2, p), sampleExpireAt)
	}
	// Truncated records, trailing bytes, nothing, and a table packed as an array.
	for _, raw := range [][]byte{v1, v2} {
		for _, n := range []int{0, 1, len(raw) / 2, len(raw) - 1} {
			add(raw[:n], sampleExpireAt)
		}
		add(append(append([]byte(nil), raw...), 0x00), sampleExpireAt)
		add(append(append([]byte(nil), raw...), v1...), sampleExpireAt)
	}
	add(append([]byte{0x9b}, v1...), sampleExpireAt)
	return seeds
}

// FuzzDecodeRecord reads arbitrary bytes as a record of either format
// with an arbitrary key expiry. A record decodes exactly when its version
// is 1, or 2 with an expiry of at least 0, and its ten fields decode with
// nothing after them; a format 2 record's times and fence follow from the
// expiry as record.lua computes them; its strings are pieces of the
// input; re-encoded as format 1, as a script rewrites it, it decodes to
// the same record; and any shorter or longer input is an error.
func FuzzDecodeRecord(f *testing.F) {
	for _, s := range decodeSeeds() {
		f.Add(s.raw, s.expireAt)
	}
	f.Fuzz(func(t *testing.T, raw []byte, expireAt int64) {
		s := string(raw)
		r, err := decodeRecord(s, expireAt)

		// The version alone, then the ten fields after it as format 1.
		d := decoder{b: s}
		version := d.int()
		fields, fieldsErr := decodeRecord("\x01"+d.b, -1)
		switch {
		case d.err != nil || fieldsErr != nil:
			if err == nil {
				t.Fatalf("%x: decoded %+v, but its version (%v) or fields (%v) do not", raw, r, d.err, fieldsErr)
			}
			return
		case version != 1 && version != 2:
			if err == nil || !strings.Contains(err.Error(), "version "+strconv.FormatInt(version, 10)+" unknown") {
				t.Fatalf("%x: version %d: got %+v, %v; want an unknown version", raw, version, r, err)
			}
			return
		case version == 2 && expireAt < 0:
			if err == nil {
				t.Fatalf("%x: format 2 with expiry %d decoded to %+v", raw, expireAt, r)
			}
			return
		case err != nil:
			t.Fatalf("%x: version %d, fields %+v, expiry %d: %v", raw, version, fields, expireAt, err)
		}

		want := fields
		if version == 2 {
			// The created field holds the PX, the deadline the TTL.
			want.created = expireAt - fields.created
			want.deadline = want.created + fields.deadline
			want.fence = (want.created + 1) * 1000
		} else if r2, err := decodeRecord(s, ^expireAt); err != nil || r2 != r {
			t.Fatalf("%x: format 1 read with expiry %d: %+v, %v; with %d: %+v", raw, ^expireAt, r2, err, expireAt, r)
		}
		if r != want {
			t.Fatalf("%x: version %d, expiry %d: got %+v, want %+v", raw, version, expireAt, r, want)
		}

		n := 0
		for _, str := range []string{r.state, r.owner, r.fingerprint, r.key, r.value} {
			if !strings.Contains(s, str) {
				t.Fatalf("%x: decoded string %q is not in the input", raw, str)
			}
			n += len(str)
		}
		if n+11 > len(s) {
			t.Fatalf("%x: %d bytes of strings and 11 values from %d bytes", raw, n, len(s))
		}

		canon := packRecord(1, r)
		for _, e := range []int64{expireAt, -1} {
			if got, err := decodeRecord(string(canon), e); err != nil || got != r {
				t.Fatalf("%x: re-encoded as %x, decoded to %+v, %v; want %+v", raw, canon, got, err, r)
			}
		}
		if version == 1 && len(canon) > len(s) {
			t.Fatalf("%x: format 1 of %d bytes re-encoded in %d", raw, len(s), len(canon))
		}

		if _, err := decodeRecord(s[:len(s)-1], expireAt); err == nil {
			t.Fatalf("%x: decoded without its last byte", raw)
		}
		if _, err := decodeRecord(s+"\x00", expireAt); err == nil {
			t.Fatalf("%x: decoded with a byte after it", raw)
		}
	})
}

// FuzzRecordFormat1 packs arbitrary fields as format 1, as the scripts
// write them: they decode as packed, whatever the key's expiry.
func FuzzRecordFormat1(f *testing.F) {
	r := sampleRecord
	f.Add(r.state, r.owner, r.fence, r.deadline, r.attempts, r.fingerprint, r.key, r.created, r.ended, r.value, int64(sampleExpireAt))
	f.Add("", "", int64(-33), int64(-129), int64(-32769), "", strings.Repeat("k", 300), int64(math.MinInt64), int64(math.MaxInt64), strings.Repeat("v", 70000), int64(-1))
	f.Fuzz(func(t *testing.T, state, owner string, fence, deadline, attempts int64, fp, key string, created, ended int64, value string, expireAt int64) {
		r := record{state: state, owner: owner, fence: fence, deadline: deadline, attempts: attempts,
			fingerprint: fp, key: key, created: created, ended: ended, value: value}
		raw := packRecord(1, r)
		if got, err := decodeRecord(string(raw), expireAt); err != nil || got != r {
			t.Fatalf("%x, expiry %d: got %+v, %v; want %+v", raw, expireAt, got, err, r)
		}
	})
}

// FuzzNewRecord decodes what the native Acquire writes for arbitrary
// owners, TTLs, PXs, fingerprints, keys and key expiries: the record it
// made, in progress at attempt 1, created the PX before the expiry, its
// lease the TTL after that, its fence the first µs after the creating
// ms; with no expiry (PEXPIRETIME below 0) it is an error. For the TTLs
// and PXs Config allows (not below 0) the bytes are what cmsgpack would
// pack.
func FuzzNewRecord(f *testing.F) {
	f.Add("0123456789abcdef0123456789abcdef", int64(30_000), int64(30_000+86_400_000), "fp", "order-42", int64(sampleExpireAt))
	f.Add("", int64(1), int64(2), "", "", int64(0))
	f.Add("o", int64(1), int64(1), "", strings.Repeat("k", 256), int64(-1))
	f.Add("o", int64(-40), int64(math.MaxInt64), "f", "k", int64(math.MaxInt64))
	f.Fuzz(func(t *testing.T, owner string, ttl, keep int64, fp, key string, expireAt int64) {
		raw := newRecord(owner, ttl, keep, fp, key)
		fields := record{state: "p", owner: owner, deadline: ttl, attempts: 1, fingerprint: fp, key: key, created: keep}
		if want := packRecord(2, fields); ttl >= 0 && keep >= 0 && string(raw) != string(want) {
			t.Fatalf("newRecord wrote %x, cmsgpack would write %x", raw, want)
		}
		r, err := decodeRecord(string(raw), expireAt)
		if expireAt < 0 {
			if err == nil {
				t.Fatalf("%x with expiry %d decoded to %+v", raw, expireAt, r)
			}
			return
		}
		created := expireAt - keep
		want := record{state: "p", owner: owner, fence: (created + 1) * 1000, deadline: created + ttl,
			attempts: 1, fingerprint: fp, key: key, created: created}
		if err != nil || r != want {
			t.Fatalf("%x, expiry %d: got %+v, %v; want %+v", raw, expireAt, r, err, want)
		}
		if got := firstFence(expireAt, keep); r.fence != got {
			t.Fatalf("fence %d, firstFence %d", r.fence, got)
		}
	})
}
