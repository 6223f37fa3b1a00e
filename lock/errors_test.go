package lock

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"

	"github.com/redis/go-redis/v9"
)

// serverError is an error reply of the server, as go-redis reports one.
type serverError string

func (e serverError) Error() string { return string(e) }
func (serverError) RedisError()     {}

// Errors are sorted into outages (ErrUnavailable), one key's bad record
// (ErrBadRecord) and the rest, keeping the original error in the chain.
func TestErrorClassification(t *testing.T) {
	unavailable := []error{
		io.EOF, io.ErrUnexpectedEOF, net.ErrClosed, redis.ErrClosed, redis.ErrPoolTimeout,
		context.DeadlineExceeded, os.ErrDeadlineExceeded,
		&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")},
		&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded},
		serverError("LOADING Redis is loading the dataset in memory"),
		serverError("READONLY You can't write against a read only replica."),
		serverError("MASTERDOWN Link with MASTER is down"),
		serverError("CLUSTERDOWN The cluster is down"),
		serverError("TRYAGAIN Multiple keys request during rehashing of slot"),
		serverError("BUSY Redis is busy running a script."),
	}
	for _, err := range unavailable {
		got := []error{classify(err)}
		if _, reply := err.(serverError); reply { // a script's reply for one key
			got = append(got, keyError(err))
		}
		for _, got := range got {
			if !errors.Is(got, ErrUnavailable) || !errors.Is(got, err) || errors.Is(got, ErrBadRecord) {
				t.Errorf("%v: got %v, want ErrUnavailable wrapping it", err, got)
			}
		}
	}
	badRecord := []error{
		serverError("WRONGTYPE Operation against a key holding the wrong kind of value"),
		serverError("ERR lock: record format version 2 unknown"),
		serverError("user_script:1: bad argument #1 to 'unpack'"),
		serverError("BUSYKEY Target key name already exists."),
	}
	for _, err := range badRecord {
		if got := keyError(err); !errors.Is(got, ErrBadRecord) || !errors.Is(got, err) || errors.Is(got, ErrUnavailable) {
			t.Errorf("per-key %v: got %v, want ErrBadRecord wrapping it", err, got)
		}
	}
	// Store-wide, but not "not now": neither.
	for _, err := range []error{
		serverError("OOM command not allowed when used memory > 'maxmemory'."),
		serverError("NOSCRIPT No matching script. Please use EVAL."),
	} {
		if got := keyError(err); errors.Is(got, ErrBadRecord) || errors.Is(got, ErrUnavailable) || !errors.Is(got, err) {
			t.Errorf("per-key %v: got %v, want it as it is", err, got)
		}
	}
	for _, err := range []error{serverError("CROSSSLOT Keys in request don't hash to the same slot"), fmt.Errorf("lock: odd reply")} {
		if got := classify(err); got != err {
			t.Errorf("%v: got %v, want it unchanged", err, got)
		}
	}
	if got := classify(classify(io.EOF)); got.Error() != classify(io.EOF).Error() {
		t.Errorf("classified twice: %v", got)
	}
}
