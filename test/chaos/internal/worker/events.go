package worker

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
)

// EventRecord is one amqpidem.Event as a JSON line of a worker's event log.
type EventRecord struct {
	Time      time.Time `json:"t"`
	Consumer  string    `json:"consumer"`
	PID       int       `json:"pid"`
	Op        string    `json:"op"`
	Outcome   string    `json:"outcome"`
	Reason    string    `json:"reason,omitempty"`
	Attempt   int       `json:"attempt,omitempty"`
	Fence     int64     `json:"fence,omitempty"`
	DelayMS   int64     `json:"delay_ms,omitempty"`
	HandlerMS int64     `json:"handler_ms,omitempty"`
	TotalMS   int64     `json:"total_ms"`
	Err       string    `json:"err,omitempty"`
	// Staged, Published, Republished and Returned are the event's
	// Outbox counts (amqpidem.OutboxCounts).
	Staged      int `json:"staged,omitempty"`
	Published   int `json:"published,omitempty"`
	Republished int `json:"republished,omitempty"`
	Returned    int `json:"returned,omitempty"`
}

// eventLog is an amqpidem.Observer appending every event to a file, one
// write per line, so that a killed process loses at most the line it was
// writing.
type eventLog struct {
	mu   sync.Mutex
	f    *os.File
	name string
	pid  int
}

func openEventLog(path, name string, pid int) (*eventLog, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("worker: event log: %w", err)
	}
	return &eventLog{f: f, name: name, pid: pid}, nil
}

// Observe appends e.
func (l *eventLog) Observe(_ context.Context, e amqpidem.Event) {
	r := EventRecord{
		Time: time.Now(), Consumer: l.name, PID: l.pid, Op: ledger.OpID(e.Key),
		Outcome: e.Outcome.String(), Reason: e.Reason, Attempt: e.Attempt, Fence: e.Fence,
		DelayMS: e.Delay.Milliseconds(), HandlerMS: e.Handler.Milliseconds(), TotalMS: e.Total.Milliseconds(),
		Staged: e.Outbox.Staged, Published: e.Outbox.Published, Republished: e.Outbox.Republished, Returned: e.Outbox.Returned,
	}
	if e.Err != nil {
		r.Err = e.Err.Error()
	}
	b, err := json.Marshal(r)
	if err != nil {
		return
	}
	b = append(b, '\n')
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f != nil {
		_, _ = l.f.Write(b)
	}
}

func (l *eventLog) close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// ReadEvents reads the event logs at paths (missing files are skipped, and
// so is a line cut short by a killed process).
func ReadEvents(paths ...string) ([]EventRecord, error) {
	var out []EventRecord
	for _, p := range paths {
		f, err := os.Open(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 16<<20)
		for sc.Scan() {
			var r EventRecord
			if json.Unmarshal(sc.Bytes(), &r) == nil {
				out = append(out, r)
			}
		}
		err = sc.Err()
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("worker: reading %s: %w", p, err)
		}
	}
	return out, nil
}
