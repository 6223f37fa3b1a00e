package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:6393", "a private redis-server 7.0 (it is flushed)")
	mode := flag.String("mode", "a", "a (amqpidem), b (correct floor) or c (incorrect lower bound)")
	k := flag.Int("k", 16, "keys per acquire pipeline and per completion call")
	callers := flag.Int("callers", 0, "mode a: this many goroutines each Acquire then Complete (the batcher groups them) instead of -k groups")
	n := flag.Int("n", 8192, "measured messages (a multiple of -k)")
	warm := flag.Int("warm", 2048, "messages before the measured ones")
	cg := flag.Int("callgrind", 0, "PID of the server under valgrind --tool=callgrind: zero its counters before and dump them after the measured messages")
	flag.Parse()

	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: *addr, PoolSize: 64, ReadTimeout: time.Minute, WriteTimeout: time.Minute})
	defer client.Close()
	if err := client.FlushAll(ctx).Err(); err != nil {
		log.Fatal(err)
	}
	d, err := newDriver(client, "floor", *k)
	if err != nil {
		log.Fatal(err)
	}
	if err := d.check(ctx); err != nil {
		log.Fatal(err)
	}
	run := func(msgs int) {
		if *callers > 0 {
			if err := d.callers(ctx, msgs, *callers); err != nil {
				log.Fatal(err)
			}
			return
		}
		for range msgs / *k {
			if err := d.group(ctx, *mode); err != nil {
				log.Fatal(err)
			}
		}
	}
	run(*warm)
	if err := client.ConfigResetStat(ctx).Err(); err != nil {
		log.Fatal(err)
	}
	cpu0 := serverCPU(ctx, client)
	if *cg > 0 {
		callgrind("-z", *cg)
	}
	start := time.Now()
	run(*n)
	wall := time.Since(start)
	if *cg > 0 {
		callgrind("-d", *cg)
	}
	cpu1 := serverCPU(ctx, client)
	stats := commandStats(ctx, client)

	label := *mode
	if *callers > 0 {
		label = fmt.Sprintf("a, %d callers", *callers)
	} else {
		label = fmt.Sprintf("%s, k=%d", label, *k)
	}
	fmt.Printf("mode %s: %d messages in %v\n", label, *n, wall.Round(time.Millisecond))
	user, sys := (cpu1[0]-cpu0[0])*1e6/float64(*n), (cpu1[1]-cpu0[1])*1e6/float64(*n)
	fmt.Printf("server CPU per message: %.2f µs (user %.2f, sys %.2f)\n", user+sys, user, sys)
	names := make([]string, 0, len(stats))
	for name := range stats {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		s := stats[name]
		fmt.Printf("  %-10s calls %7d (%.3f per message)  usec %8d (%.2f per message)\n",
			name, s.calls, float64(s.calls)/float64(*n), s.usec, float64(s.usec)/float64(*n))
	}
}

// serverCPU returns the server's used_cpu_user and used_cpu_sys, seconds.
func serverCPU(ctx context.Context, c *redis.Client) [2]float64 {
	info, err := c.Info(ctx, "cpu").Result()
	if err != nil {
		log.Fatal(err)
	}
	var out [2]float64
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		name, val, _ := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		switch name {
		case "used_cpu_user":
			out[0], _ = strconv.ParseFloat(val, 64)
		case "used_cpu_sys":
			out[1], _ = strconv.ParseFloat(val, 64)
		}
	}
	return out
}

type cmdStat struct{ calls, usec int64 }

// commandStats returns INFO commandstats (reset before the measured part),
// without the INFO and CONFIG calls of this program.
func commandStats(ctx context.Context, c *redis.Client) map[string]cmdStat {
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		log.Fatal(err)
	}
	out := map[string]cmdStat{}
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		name, rest, ok := strings.Cut(line, ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		name = strings.TrimPrefix(name, "cmdstat_")
		if name == "info" || strings.HasPrefix(name, "config") {
			continue
		}
		var s cmdStat
		for _, f := range strings.Split(rest, ",") {
			key, val, _ := strings.Cut(f, "=")
			switch key {
			case "calls":
				s.calls, _ = strconv.ParseInt(val, 10, 64)
			case "usec":
				s.usec, _ = strconv.ParseInt(val, 10, 64)
			}
		}
		out[name] = s
	}
	return out
}

// callgrind runs callgrind_control op on pid.
func callgrind(op string, pid int) {
	out, err := exec.Command("callgrind_control", op, strconv.Itoa(pid)).CombinedOutput()
	if err != nil {
		log.Fatalf("callgrind_control %s %d: %v: %s", op, pid, err, out)
	}
	fmt.Fprintf(os.Stderr, "callgrind_control %s %d: %s", op, pid, out)
}
