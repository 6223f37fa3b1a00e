//go:build unix

package main

import (
	"net"
	"os"
	"runtime"
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

// TestListensOn checks how brokerPID tells RabbitMQ nodes apart: by the
// process holding the socket that listens on the AMQP port.
func TestListensOn(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("/proc/net/tcp is Linux's")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	if !listensOn(os.Getpid(), port) {
		t.Fatalf("this process listens on %d: listensOn says it does not", port)
	}
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	if listensOn(os.Getpid(), port) {
		t.Fatalf("the listener on %d is closed: listensOn says this process still listens", port)
	}
}
