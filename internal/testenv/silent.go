package testenv

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// SilentServer is a TCP server on loopback that accepts connections and
// never answers: a broker node or a Redis that hangs (overloaded, half
// dead, a firewall that lets the handshake through). It stops, closing
// every connection it accepted, when the test ends.
type SilentServer struct {
	ln       net.Listener
	mu       sync.Mutex
	conns    []net.Conn
	accepted atomic.Int32
}

// NewSilentServer starts a SilentServer on 127.0.0.1 and a free port.
func NewSilentServer(t testing.TB) *SilentServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &SilentServer{ln: ln}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
			s.accepted.Add(1)
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, c := range s.conns {
			_ = c.Close()
		}
	})
	return s
}

// Addr is the server's host:port.
func (s *SilentServer) Addr() string { return s.ln.Addr().String() }

// Accepted is how many connections the server has accepted.
func (s *SilentServer) Accepted() int { return int(s.accepted.Load()) }
