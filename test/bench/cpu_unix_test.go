//go:build unix

package main

import (
	"os"
	"testing"
)

// TestBrokerPIDRemote checks that the broker's CPU is read only for a
// node on this machine: a URL naming another host gives no pid, whatever
// runs here, so that machine_us never counts a local node's CPU for a
// remote one's.
func TestBrokerPIDRemote(t *testing.T) {
	for _, u := range []string{"amqp://guest:guest@10.1.2.3:5672/", "amqps://rabbit.example.com/", "::not a url"} {
		if got := brokerPID(u); got != 0 {
			t.Errorf("brokerPID(%q) = %d, want 0", u, got)
		}
	}
}

// TestSelfSyscalls checks that a write of this process is counted.
func TestSelfSyscalls(t *testing.T) {
	_, w0 := selfSyscalls()
	f := t.TempDir() + "/x"
	if err := writeOnce(f); err != nil {
		t.Fatal(err)
	}
	if _, w1 := selfSyscalls(); w1 <= w0 {
		t.Errorf("writes after a write: %d, before %d; want more", w1, w0)
	}
}

func writeOnce(path string) error {
	return os.WriteFile(path, []byte("x"), 0o600)
}
