package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// replica is a redis-server this bench starts as a replica of the bench's
// Redis, for the unique-wait variant (lock.Config.Replicas 1).
type replica struct {
	cmd  *exec.Cmd
	dir  string
	addr string
}

// startReplica starts redis-server (from PATH) on a free loopback port as a
// replica of master, and waits until its link is up. It returns an error
// saying why when it cannot: the variant is then skipped.
func startReplica(ctx context.Context, master string) (*replica, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not on PATH: %w", err)
	}
	host, port, err := net.SplitHostPort(master)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	_, myPort, _ := net.SplitHostPort(addr)
	dir, err := os.MkdirTemp("", "amqpidem-bench-replica-")
	if err != nil {
		return nil, err
	}
	r := &replica{dir: dir, addr: addr}
	r.cmd = exec.Command(bin, "--port", myPort, "--bind", "127.0.0.1", "--replicaof", host, port,
		"--save", "", "--appendonly", "no", "--dir", dir, "--logfile", dir+"/redis.log")
	r.cmd.SysProcAttr = childAttr()
	if err := r.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		info, err := c.Info(wctx, "replication").Result()
		if err == nil && strings.Contains(info, "master_link_status:up") {
			return r, nil
		}
		select {
		case <-wctx.Done():
			r.stop()
			return nil, fmt.Errorf("replica %s of %s: link not up in 30 s (last: %v)", addr, master, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// stop kills the replica and removes its directory.
func (r *replica) stop() {
	_ = r.cmd.Process.Kill()
	_ = r.cmd.Wait()
	os.RemoveAll(r.dir)
}
