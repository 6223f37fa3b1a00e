package pgstore

import (
	"encoding/hex"
	"testing"
)

// keyBytes gives each key's bytes, each slice capped so that appending to
// one cannot overwrite the next; newOwners gives distinct tokens of 32 hex
// digits, as lock.NewOwner does.
func TestBatchArrayHelpers(t *testing.T) {
	in := []string{"a", "", "nul\x00\xff", "last"}
	keys := keyBytes(len(in), func(j int) string { return in[j] })
	for j, k := range keys {
		if string(k) != in[j] || cap(k) != len(k) {
			t.Errorf("key %d: %q cap %d, want %q capped", j, k, cap(k), in[j])
		}
	}
	_ = append(keys[0], 'x')
	if string(keys[1]) != "" || string(keys[2]) != in[2] {
		t.Errorf("appending to a key changed the next: %q", keys)
	}
	owners := newOwners(50)
	seen := map[string]bool{}
	for _, o := range owners {
		if _, err := hex.DecodeString(o); err != nil || len(o) != 32 || seen[o] {
			t.Errorf("owner %q: not 32 hex digits, or seen before", o)
		}
		seen[o] = true
	}
	if len(newOwners(0)) != 0 {
		t.Error("newOwners(0) not empty")
	}
}
