package lock

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestRecordKey(t *testing.T) {
	k := recordKey("amqpidem", "{order}-1")
	if !strings.HasPrefix(k, "amqpidem:{") || !strings.HasSuffix(k, "}") || len(k) != len("amqpidem:{}")+32 {
		t.Fatalf("recordKey: got %q", k)
	}
	if strings.Count(k, "{") != 1 || strings.Count(k, "}") != 1 {
		t.Fatalf("user braces leaked into the Redis key: %q", k)
	}
	// User-chosen hash tags must not pin records to one slot: the tag is
	// the digest, different for each key.
	seen := map[string]bool{}
	for _, key := range []string{"{hot}a", "{hot}b", "{hot}c"} {
		tag := recordKey("p", key)
		if seen[tag] {
			t.Fatalf("two keys share a record key: %q", tag)
		}
		seen[tag] = true
	}
	// The prefix is hashed too: "a"+":b" and "a:"+"b" differ.
	if recordKey("a", ":b") == recordKey("a:", "b") {
		t.Fatal("namespaces collide")
	}
}

func TestTruncate(t *testing.T) {
	tests := []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"exactly", 7, "exactly"},
		{strings.Repeat("x", 30), 20, "xxxxxx…(truncated)"},
		{"abcdef", 3, "abc"},
		// Cut at a rune's start, never in the middle of one: the text
		// stays valid UTF-8.
		{"ab" + strings.Repeat("€", 10), 20, "ab€…(truncated)"},
		{"ab" + strings.Repeat("€", 10), 21, "ab€…(truncated)"},
		{"ab" + strings.Repeat("€", 10), 22, "ab€€…(truncated)"},
		{"€€", 4, "€"},
		{"€€", 2, ""},
		{"aé", 2, "a"},
	}
	for _, tc := range tests {
		if got := CutText(tc.in, tc.n); got != tc.want || len(got) > tc.n || !utf8.ValidString(got) {
			t.Errorf("CutText(%q, %d): got %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}

// A lease carries its record's key, but a store uses it only if the key is
// in its own namespace.
func TestKeyOfOtherStoresLease(t *testing.T) {
	a := &RedisStore{cfg: Config{Prefix: "a"}.WithDefaults()}
	ab := &RedisStore{cfg: Config{Prefix: "a:b"}.WithDefaults()}
	l := Lease{Key: "k", rkey: recordKey("a:b", "k")}
	if got, want := ab.keyOf(l), recordKey("a:b", "k"); got != want {
		t.Fatalf("own lease: %q, want %q", got, want)
	}
	if got, want := a.keyOf(l), recordKey("a", "k"); got != want {
		t.Fatalf("other store's lease: %q, want %q", got, want)
	}
}

// A batch's owner tokens and record keys, made as one string, are each
// what NewOwner and recordKey make, a request that failed its check left
// out.
func TestBatchKeys(t *testing.T) {
	reqs := []Request{{Key: "a"}, {Key: ""}, {Key: "a longer key \x00 with a NUL"}, {Key: "a"}}
	todo := []int{0, 2, 3}
	for _, prefix := range []string{"", "p", strings.Repeat("x", maxPrefixLen)} {
		k := newBatchKeys(prefix, reqs, todo)
		seen := map[string]bool{}
		for _, i := range todo {
			if got, want := k.rkey(i), recordKey(prefix, reqs[i].Key); got != want {
				t.Errorf("prefix %q: rkey(%d) = %q, want %q", prefix, i, got, want)
			}
			o := k.owner(i)
			if o != string(k.owners[i][:]) || len(o) != 32 {
				t.Errorf("prefix %q: owner(%d) = %q, tokens %q", prefix, i, o, k.owners[i][:])
			}
			if seen[o] {
				t.Errorf("owner token %q twice", o)
			}
			seen[o] = true
		}
	}
}
