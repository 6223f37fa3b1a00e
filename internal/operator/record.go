package operator

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// LeaseText describes a record's lease for people.
func LeaseText(r lock.Record) string {
	switch {
	case r.Live():
		return fmt.Sprintf("held, %v left, owner %s", r.LeaseLeft.Round(time.Millisecond), r.Owner)
	case r.State == lock.StateInProgress:
		return fmt.Sprintf("expired (owner %s); the next delivery takes it over", r.Owner)
	}
	return "none"
}

// KeyFree is err without the store key skey in its text: the lock
// package's errors quote it ("orders\x00order-1042"), which is the
// endpoint and key joined as no operator typed them. It is the first of
// err's causes that does not quote skey, else err's text with it
// replaced.
func KeyFree(err error, skey string) error {
	if skey == "" {
		return err
	}
	q := strconv.Quote(skey)
	for e := err; e != nil; e = errors.Unwrap(e) {
		if !strings.Contains(e.Error(), q) {
			return e
		}
	}
	return errors.New(strings.ReplaceAll(err.Error(), q, "the record"))
}
