package lock

import (
	"strings"
	"testing"
)

// A format 2 record decodes to the times and fence record.lua computes
// from the key's expiry, whatever the sizes of its strings.
func TestRecordFormat2RoundTrip(t *testing.T) {
	for _, n := range []int{0, 31, 32, 255, 256, 1024, 70000} {
		key := strings.Repeat("k", n)
		raw := string(newRecord("owner", 30_000, 30_000+86_400_000, "fp", key))
		const expireAt = 1_800_000_000_000 + 30_000 + 86_400_000
		r, err := decodeRecord(raw, expireAt)
		if err != nil {
			t.Fatalf("key of %d bytes: %v", n, err)
		}
		created := int64(1_800_000_000_000)
		want := record{state: "p", owner: "owner", fence: (created + 1) * 1000, deadline: created + 30_000,
			attempts: 1, fingerprint: "fp", key: key, created: created}
		if r != want {
			t.Fatalf("key of %d bytes: got %+v, want %+v", n, r, want)
		}
	}
}

// Integers in every width cmsgpack uses, negative ones included.
func TestRecordIntegers(t *testing.T) {
	for _, n := range []int64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1_800_000_000_000_000, -1, -32, -33, -200, -40000, -1 << 40} {
		d := decoder{b: string(appendInt(nil, n))}
		if got := d.int(); got != n || d.err != nil || d.b != "" {
			t.Fatalf("%d: decoded %d, rest %q, %v", n, got, d.b, d.err)
		}
	}
}

// Damaged records are errors, never half-read records.
func TestRecordDamaged(t *testing.T) {
	good := string(newRecord("owner", 1, 2, "", "k"))
	for i := 0; i < len(good); i++ {
		if _, err := decodeRecord(good[:i], 100); err == nil {
			t.Fatalf("%d of %d bytes decoded without error", i, len(good))
		}
	}
	if _, err := decodeRecord(good+"x", 100); err == nil {
		t.Fatal("trailing bytes decoded without error")
	}
	if _, err := decodeRecord("\x03"+good[1:], 100); err == nil || !strings.Contains(err.Error(), "version 3") {
		t.Fatalf("version 3: %v", err)
	}
	if _, err := decodeRecord(good, -1); err == nil {
		t.Fatal("format 2 without an expiry decoded without error")
	}
	if _, err := decodeRecord("\x01\x01", 100); err == nil {
		t.Fatal("an integer where the state belongs decoded without error")
	}
}
