package lock

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// Bounds of a ListRequest's Scan.
const (
	// DefaultListScan is the Scan of a ListRequest that gives none.
	DefaultListScan = 1000
	// MaxListScan is the largest Scan a Lister accepts.
	MaxListScan = 10000
)

// ErrListUnsupported means the store cannot list its records as it is
// configured: a dynamostore Store whose client has no Scan.
var ErrListUnsupported = errors.New("lock: listing not supported")

// Lister lists a store's records page by page, for operators' tools (the
// console's records by state). RedisStore and MemoryStore implement it,
// as do pgstore's and dynamostore's stores.
//
// A listing reads records as they are, without a lock and not as one
// snapshot: a record made, changed or deleted during a listing may be
// seen in either form, or not at all. A record that exists, unchanged,
// from the first page to the last is returned once (a RedisStore may
// return it twice when Redis resizes its keyspace meanwhile: SCAN's own
// guarantee). Each call reads at most about ListRequest.Scan records,
// whatever the filters let through, so a page may hold fewer records
// than were read, or none, with more to come (ListPage.Next).
type Lister interface {
	// List returns the records of the page at req.Cursor that pass req's
	// filters, and where the next page starts. A Cursor that is not one
	// this store returned is an error wrapping ErrBadCursor.
	List(ctx context.Context, req ListRequest) (ListPage, error)
}

// ErrBadCursor means a ListRequest's Cursor is not one that the store's
// List returned.
var ErrBadCursor = errors.New("lock: bad list cursor")

// ListRequest asks a Lister for one page of records.
type ListRequest struct {
	// Prefix keeps the records whose key starts with it; "" keeps every
	// key. amqpidem.StoreKey(endpoint, "") keeps one endpoint's.
	Prefix string
	// State keeps the records in this state; "" keeps every state.
	State State
	// Cursor is where the page starts: "" for the first page, then the
	// Next of the page before.
	Cursor string
	// Values asks for each completed record's Value (its stored result,
	// up to the store's MaxResultSize bytes each); without it Value is
	// nil.
	Values bool
	// Scan bounds the work of one call: at most this many records are
	// read (for a RedisStore, about this many: it is SCAN's COUNT, which
	// a bucket of several keys can exceed by a few). Zero means
	// DefaultListScan; at most MaxListScan.
	Scan int
}

// ListPage is one page of a listing.
type ListPage struct {
	// Records are the records read that pass the filters, in the
	// store's order, each as Inspect would report it but without Value
	// unless ListRequest.Values asks for it.
	Records []Record
	// Scanned is how many records the call read, filtered out or not.
	Scanned int
	// Next is the Cursor of the next page; "" when the listing is done.
	Next string
}

// Check validates r and returns it with its defaults: an error names a
// State that is not a record state, a negative Scan or one above
// MaxListScan, or a Prefix longer than MaxKeyLen.
func (r ListRequest) Check() (ListRequest, error) {
	switch {
	case r.State != "" && r.State.Letter() == 0:
		return r, fmt.Errorf("lock: list: %q is not a record state", r.State)
	case r.Scan < 0 || r.Scan > MaxListScan:
		return r, fmt.Errorf("lock: list: Scan %d is not from 1 to %d", r.Scan, MaxListScan)
	case len(r.Prefix) > MaxKeyLen:
		return r, fmt.Errorf("lock: list: Prefix is %d bytes, at most %d", len(r.Prefix), MaxKeyLen)
	}
	if r.Scan == 0 {
		r.Scan = DefaultListScan
	}
	return r, nil
}

// Keep reports whether a record of key in state (its one-letter form)
// passes r's filters.
func (r ListRequest) Keep(key string, state byte) bool {
	return strings.HasPrefix(key, r.Prefix) && (r.State == "" || r.State.Letter() == state)
}
