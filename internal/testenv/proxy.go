package testenv

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
)

// Proxy is a TCP proxy on loopback for fault tests. Each connection
// accepted on its address is dialled through to its target; what the
// client sends is copied to the server by the up function StartProxy was
// given, what the server sends to the client by down (io.Copy when nil),
// and both connections are closed as soon as either returns. A test makes
// its fault in up or down: hold data back, drop it, or return to cut the
// connection.
type Proxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

// StartProxy starts a Proxy to target (host:port) on a free loopback port.
// It stops in t.Cleanup, closing every connection and waiting for up and
// down to return: they must return once their connections are closed (a
// cleanup the test registers after StartProxy runs before, to release
// what up or down may be waiting for).
func StartProxy(t testing.TB, target string, up, down func(from, to net.Conn)) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	copyAll := func(from, to net.Conn) { _, _ = io.Copy(to, from) }
	if up == nil {
		up = copyAll
	}
	if down == nil {
		down = copyAll
	}
	p := &Proxy{ln: ln, target: target}
	p.wg.Add(1)
	go p.accept(up, down)
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// URL is rawURL (an AMQP URL, a PostgreSQL DSN) with the proxy's address
// in place of its host and port.
func (p *Proxy) URL(t testing.TB, rawURL string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = p.Addr()
	return u.String()
}

func (p *Proxy) accept(up, down func(from, to net.Conn)) {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		p.wg.Add(2)
		for _, run := range []func(){func() { up(client, server) }, func() { down(server, client) }} {
			go func() {
				defer p.wg.Done()
				run()
				_ = client.Close()
				_ = server.Close()
			}()
		}
	}
}
