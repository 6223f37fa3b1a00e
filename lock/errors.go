package lock

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/redis/go-redis/v9"
)

// notNowPrefixes start the error replies of a server that cannot answer
// now but may soon: ErrUnavailable.
var notNowPrefixes = []string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY"}

// storeWidePrefixes start error replies about the server, not about one
// key's record, when a script answers them for a single key.
var storeWidePrefixes = append([]string{"OOM", "NOSCRIPT"}, notNowPrefixes...)

// hasPrefix reports whether msg starts with one of prefixes as a word.
func hasPrefix(msg string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(msg, p) && (len(msg) == len(p) || msg[len(p)] == ' ') {
			return true
		}
	}
	return false
}

// isUnavailable reports whether err says the store could not answer.
func isUnavailable(err error) bool {
	var ne net.Error
	var re redis.Error
	switch {
	case err == nil:
		return false
	case errors.As(err, &ne), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, net.ErrClosed), errors.Is(err, redis.ErrClosed), errors.Is(err, context.DeadlineExceeded):
		return true
	case errors.As(err, &re):
		return hasPrefix(re.Error(), notNowPrefixes)
	}
	return errors.Is(err, redis.ErrPoolTimeout)
}

// classify wraps err with ErrUnavailable when the store could not answer.
func classify(err error) error {
	if isUnavailable(err) && !errors.Is(err, ErrUnavailable) {
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return err
}

// keyError makes a script's error reply for one key of a call: a fault of
// that key's record (ErrBadRecord) unless it is about the server.
func keyError(err error) error {
	if hasPrefix(err.Error(), storeWidePrefixes) {
		return classify(err)
	}
	return fmt.Errorf("%w: %w", ErrBadRecord, err)
}

// refusedWhole reports whether a script call over many keys was refused as
// a whole for a reason that a call over one key may not meet (a proxy's
// CROSSSLOT, say): an error reply that is not about the server's state.
func refusedWhole(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && !hasPrefix(re.Error(), storeWidePrefixes)
}

// notSent reports whether err says the command never left the client: the
// connection could not be made.
func notSent(err error) bool {
	var oe *net.OpError
	return (errors.As(err, &oe) && oe.Op == "dial") || errors.Is(err, redis.ErrPoolTimeout)
}
