//go:build unix

package main

import (
	"cmp"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
)

// machineCPU is the busy CPU time of the whole machine so far (every
// process: RabbitMQ, Redis and this one), from /proc/stat on Linux, or 0
// elsewhere.
func machineCPU() time.Duration {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	fields := strings.Fields(line)
	if len(fields) < 8 || fields[0] != "cpu" {
		return 0
	}
	// user nice system idle iowait irq softirq steal ...: all but idle
	// and iowait are busy.
	var busy int64
	for i, f := range fields[1:] {
		if i == 3 || i == 4 {
			continue
		}
		n, _ := strconv.ParseInt(f, 10, 64)
		busy += n
	}
	// /proc/stat counts in USER_HZ, 100 per second on every Linux port.
	return time.Duration(busy) * 10 * time.Millisecond
}

// procStat reads /proc/<pid>/stat: the parent's pid and the CPU time of
// the process plus that of its children it has waited for (utime + stime +
// cutime + cstime). ok is false when it cannot be read.
func procStat(pid int) (ppid int, cpu time.Duration, ok bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// The command name, in parentheses, may hold spaces: fields start
	// after its closing parenthesis, at field 3 (state).
	i := strings.LastIndexByte(string(data), ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 15 {
		return 0, 0, false
	}
	ppid, _ = strconv.Atoi(f[1])
	var ticks int64
	for _, s := range f[11:15] { // fields 14-17: utime stime cutime cstime
		n, _ := strconv.ParseInt(s, 10, 64)
		ticks += n
	}
	// USER_HZ, 100 per second on every Linux port.
	return ppid, time.Duration(ticks) * 10 * time.Millisecond, true
}

// postmasterOf is the pid of the PostgreSQL postmaster whose backend has
// pid backend, if both are processes named postgres visible in this
// machine's /proc; else 0 (a server in a container or elsewhere).
func postmasterOf(backend int) int {
	comm := func(pid int) string {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
		return strings.TrimSpace(string(b))
	}
	ppid, _, ok := procStat(backend)
	if !ok || ppid <= 1 || comm(backend) != "postgres" || comm(ppid) != "postgres" {
		return 0
	}
	return ppid
}

// treeCPU is the CPU time of process pid and its children so far,
// those that ended included (once waited for, as the postmaster does),
// or 0 when pid is 0 or not readable. One level of children: PostgreSQL's
// backends and background processes are the postmaster's.
func treeCPU(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	_, total, ok := procStat(pid)
	if !ok {
		return 0
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, cpu, ok := procStat(child); ok && ppid == pid {
			total += cpu
		}
	}
	return total
}

// brokerPID is the pid of the RabbitMQ node at amqpURL when it runs on
// this machine: amqpURL's host is a loopback one, and the node is the one
// process named beam.smp that boots RabbitMQ ("-s rabbit boot" in its
// command line; rabbitmqctl and rabbitmq-diagnostics are Erlang VMs named
// beam.smp too, which do not) or, when several do (another test's cluster
// nodes), the one of them holding the socket listening on amqpURL's port
// (/proc/net/tcp, and its /proc/<pid>/fd, readable by root or the
// broker's user). Else 0: its CPU is not measured (a broker elsewhere, or
// in a container this /proc does not show, or nodes that cannot be told
// apart here).
func brokerPID(amqpURL string) int {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return 0
	}
	if h := u.Hostname(); h != "localhost" {
		if ip := net.ParseIP(h); ip == nil || !ip.IsLoopback() {
			return 0
		}
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	var nodes []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, _ := os.ReadFile("/proc/" + e.Name() + "/comm")
		if strings.TrimSpace(string(comm)) != "beam.smp" {
			continue
		}
		args, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if strings.Contains(string(args), "\x00-s\x00rabbit\x00boot\x00") {
			nodes = append(nodes, pid)
		}
	}
	if len(nodes) == 1 {
		return nodes[0]
	}
	port, err := strconv.Atoi(cmp.Or(u.Port(), "5672"))
	if err != nil {
		return 0
	}
	for _, pid := range nodes {
		if listensOn(pid, port) {
			return pid
		}
	}
	return 0
}

// listensOn reports whether process pid holds a TCP socket listening on
// port (false when its /proc/<pid>/fd cannot be read).
func listensOn(pid, port int) bool {
	inodes := listening(port)
	fds, _ := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	for _, fd := range fds {
		link, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/fd/" + fd.Name())
		if inode, ok := strings.CutPrefix(link, "socket:["); err == nil && ok && inodes[strings.TrimSuffix(inode, "]")] {
			return true
		}
	}
	return false
}

// listening is the inodes of the TCP sockets listening on port, from
// /proc/net/tcp and /proc/net/tcp6.
func listening(port int) map[string]bool {
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n")[1:] {
			// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
			fields := strings.Fields(line)
			if len(fields) < 10 || fields[3] != "0A" { // 0A: LISTEN
				continue
			}
			_, p, ok := strings.Cut(fields[1], ":")
			if n, err := strconv.ParseInt(p, 16, 32); ok && err == nil && n == int64(port) {
				inodes[fields[9]] = true
			}
		}
	}
	return inodes
}

// pidCPU is the CPU time of process pid so far (its children it waited
// for included); ok is false when pid is 0 or not readable (the process
// ended: a broker restarted by someone else's test).
func pidCPU(pid int) (cpu time.Duration, ok bool) {
	if pid == 0 {
		return 0, false
	}
	_, cpu, ok = procStat(pid)
	return cpu, ok
}

// selfSyscalls is the read and write system calls this process has made
// so far (/proc/self/io: syscr, syscw; socket reads and writes included),
// or 0, 0 when they cannot be read. Each flush of a connection's buffer
// is one write, so that writes per message count the flushes.
func selfSyscalls() (reads, writes int64) {
	data, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return 0, 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		name, v, ok := strings.Cut(line, ": ")
		if !ok {
			continue
		}
		n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		switch name {
		case "syscr":
			reads = n
		case "syscw":
			writes = n
		}
	}
	return reads, writes
}
