package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/operator"
	"github.com/amqpidem/amqpidem/lock"
)

// Bounds of the records pages, in records read from the store per page
// load (lock.ListRequest.Scan, summed over the page's List calls).
const (
	// recordsPage is how many records a records page shows: about as
	// many (a store's page is never cut, so that the next one goes on
	// where it ended).
	recordsPage = 50
	// defaultListScan is Config.ListScan's default.
	defaultListScan = 2000
	// overviewScan is how many records the overview reads per endpoint
	// to count them by state.
	overviewScan = 1000
	// overviewCalls bounds the List calls the overview makes per
	// endpoint to read overviewScan records.
	overviewCalls = 10
)

// filters are the records pages' state filters: a lock.State, or
// "expired" (in progress with an expired lease: its consumer died or
// stopped renewing it, and the next delivery takes it over), "stalled"
// (in progress with a live lease whose heartbeat stalled: see
// leaseHealth) or "unpublished".
var filters = []string{string(lock.StateFailed), expired, stalled, unpublished, string(lock.StateInProgress), string(lock.StateCompleted),
	string(lock.StateReleased), string(lock.StateCancelled)}

// expired and stalled are the records pages' filters of expired leases
// and of live leases whose heartbeat stalled; unpublished that of
// completed records with staged messages (amqpidem.Stage) not published:
// pending (the next delivery of the message publishes them) or returned
// by the broker ("amqpidem outbox redrive" publishes them again).
const (
	expired     = "expired"
	stalled     = "stalled"
	unpublished = "unpublished"
)

// valuesScan bounds the records a page reads with their values (the
// unpublished filter): each may be up to the store's MaxResultSize.
const valuesScan = 500

// listed is a record as a records page shows it.
type listed struct {
	Key, Endpoint string
	lock.Record
	Lease string
	// Health is its lease's age and health under Config.LeaseTTL.
	Health leaseHealth
	// Staged says how many staged messages are in each state, for the
	// unpublished filter ("" otherwise).
	Staged string
}

// lister is the store's lock.Lister, or the problem page saying there is
// none.
func (c *Console) lister() (lock.Lister, *problem) {
	if c.cfg.Admin == nil {
		return nil, &problem{Status: http.StatusServiceUnavailable, Title: "No store",
			What: "This console was given no store to read records from.",
			Do:   "Give it the consumers' store (Config.Admin; the command's --redis, --postgres or --dynamodb-table).", Overview: true}
	}
	l, ok := c.cfg.Admin.(lock.Lister)
	if !ok {
		return nil, &problem{Status: http.StatusNotImplemented, Title: "This store cannot list",
			What: fmt.Sprintf("%s cannot list its records (its Admin is no lock.Lister): keys are looked up by name only.", c.storeName()),
			Do:   "Look up a key from the overview, or give the console a store of this module.", Overview: true}
	}
	return l, nil
}

// records is GET /records?endpoint=E&state=S[&cursor=C]: a page of the
// endpoint's records in a state, read with lock.Lister in calls that
// together read at most Config.ListScan records, with a link to the next
// page when the store has more.
func (c *Console) records(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	endpoint, filter, cursor := q.Get("endpoint"), q.Get("state"), q.Get("cursor")
	if endpoint == "" || len(endpoint) > lock.MaxKeyLen || len(cursor) > 4*lock.MaxKeyLen {
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Which endpoint?",
			What: fmt.Sprintf("A records page needs the consumer's endpoint (its Config.Endpoint, by default its queue), at most %d bytes.", lock.MaxKeyLen),
			Do:   "Fill in the endpoint in the overview's form, or follow a count of the overview.", Overview: true})
		return
	}
	state := lock.State(filter)
	budget := c.cfg.ListScan
	switch {
	case filter == stalled || filter == expired:
		state = lock.StateInProgress
	case filter == unpublished:
		state, budget = lock.StateCompleted, min(budget, valuesScan)
	case filter != "" && state.Letter() == 0:
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "No such state",
			What: fmt.Sprintf("state %q is none of failed, expired, stalled, unpublished, in_progress, completed, released, cancelled.", filter),
			Do:   "Pick a state from the records page's links, or leave state out for every state.", Overview: true})
		return
	}
	l, p := c.lister()
	if p != nil {
		c.problem(w, r, p)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	prefix := amqpidem.StoreKey(endpoint, "")
	req := lock.ListRequest{Prefix: prefix, State: state, Cursor: cursor, Values: filter == unpublished}
	var (
		shown   []listed
		scanned int
		calls   int
	)
	for {
		// Read about as many records as should give the rest of the
		// page, by the share that matched so far (all, at first): a
		// page of 50 reads 50 records when each matches, the whole
		// budget when few do.
		want := recordsPage - len(shown)
		guess := want
		if scanned > 0 {
			guess = want * scanned / max(len(shown), 1)
		}
		req.Scan = max(min(guess, budget-scanned, lock.MaxListScan), 1)
		page, err := l.List(ctx, req)
		calls++
		if err != nil {
			c.problem(w, r, c.listProblem(r, err, calls == 1 && cursor != ""))
			return
		}
		scanned += page.Scanned
		for _, rec := range page.Records {
			v := listed{Key: rec.Key[len(prefix):], Endpoint: endpoint, Record: rec, Lease: operator.LeaseText(rec),
				Health: health(rec, c.cfg.LeaseTTL)}
			if (filter == stalled && !v.Health.Stalled) || (filter == expired && !v.Health.Expired) {
				continue
			}
			if filter == unpublished {
				if v.Staged = stagedLeft(rec.Value); v.Staged == "" {
					continue
				}
				v.Value = nil
			}
			shown = append(shown, v)
		}
		req.Cursor = page.Next
		// Stop at a full page, at the end, or when the page load's
		// budget is spent: the next page goes on from here.
		if len(shown) >= recordsPage || page.Next == "" || scanned >= budget {
			break
		}
	}
	data := struct {
		page
		Endpoint, Filter string
		Filters          []string
		Records          []listed
		Scanned, Budget  int
		Next, First      string
		LeaseTTL         time.Duration
	}{page: c.page("records of " + operator.Escape(endpoint)), Endpoint: endpoint, Filter: filter, Filters: filters,
		Records: shown, Scanned: scanned, Budget: budget, LeaseTTL: c.cfg.LeaseTTL}
	if req.Cursor != "" {
		data.Next = "records?" + url.Values{"endpoint": {endpoint}, "state": {filter}, "cursor": {req.Cursor}}.Encode()
	}
	if cursor != "" {
		data.First = "records?" + url.Values{"endpoint": {endpoint}, "state": {filter}}.Encode()
	}
	c.render(w, r, http.StatusOK, "records.html", data)
}

// listProblem is the page for err, an error of List; badCursor: the
// request's cursor was the page's first.
func (c *Console) listProblem(r *http.Request, err error, badCursor bool) *problem {
	switch {
	case errors.Is(err, lock.ErrBadCursor) && badCursor:
		return &problem{Status: http.StatusBadRequest, Title: "Bad cursor",
			What: "This page's cursor is not one the store gave: it was cut or changed, or comes from another store.",
			Do:   "Start the listing again from its first page.", Overview: true}
	case errors.Is(err, lock.ErrListUnsupported):
		return &problem{Status: http.StatusNotImplemented, Title: "This store cannot list",
			What: err.Error(), Do: "Look up a key by name from the overview.", Overview: true}
	}
	return c.failed(r, err, c.storeName(), "Check that the store is up and reachable from this console, then reload.")
}

// stateCount is an endpoint's records counted by state: exactly, by a
// lock.Counter within Config.CountBudget, else among at most
// overviewScan read.
type stateCount struct {
	Endpoint string
	// Counts by filter; InProgress counts the live leases whose
	// heartbeat did not stall.
	Failed, Expired, Stalled, InProgress, Completed, Other int
	// Exact: counted by the store (Total is every record); else Read is
	// how many records were read, All whether they were all the
	// endpoint's (else each count is a lower bound), and CountErr why
	// the store's count was not used ("" when the store has none).
	Exact    bool
	Total    int
	Read     int
	All      bool
	CountErr string
	Err      string
}

// counts counts the records of each configured queue's endpoint by state:
// with a store that is a lock.Counter, exactly within Config.CountBudget;
// else, or when that fails, among at most overviewScan records read.
func (c *Console) counts(ctx context.Context, l lock.Lister) []stateCount {
	out := make([]stateCount, 0, len(c.cfg.Queues))
	counter, _ := c.cfg.Admin.(lock.Counter)
	// The endpoints' counts share the budget: a page load spends at most
	// CountBudget counting, however many queues it shows.
	countEnd := time.Now().Add(c.cfg.CountBudget)
	for _, q := range c.cfg.Queues {
		sc := stateCount{Endpoint: q}
		prefix := amqpidem.StoreKey(q, "")
		left := time.Until(countEnd)
		if counter != nil && left < time.Millisecond {
			sc.CountErr = fmt.Sprintf("the %v budget of the store's counts was spent on the endpoints above", c.cfg.CountBudget)
		}
		if counter != nil && left >= time.Millisecond {
			n, err := counter.Count(ctx, lock.CountRequest{Prefix: prefix, Budget: left,
				LeaseBelow: c.cfg.LeaseTTL - c.cfg.LeaseTTL*stallNum/stallDen})
			if err == nil {
				sc.Exact = true
				sc.Failed, sc.Completed = n.States[lock.StateFailed], n.States[lock.StateCompleted]
				sc.Expired, sc.Stalled = n.Expired, n.LeaseBelow
				sc.InProgress = n.States[lock.StateInProgress] - n.Expired - n.LeaseBelow
				sc.Other = n.States[lock.StateReleased] + n.States[lock.StateCancelled]
				for _, v := range n.States {
					sc.Total += v
				}
				out = append(out, sc)
				continue
			}
			sc.CountErr = err.Error()
			if errors.Is(err, lock.ErrCountBudget) {
				sc.CountErr = fmt.Sprintf("the store's count took more than its %v budget", c.cfg.CountBudget)
			}
		}
		// A List call reads up to Scan records, but may read fewer (a
		// Redis SCAN step over keys of other endpoints): calls follow its
		// cursor until overviewScan were read, or all, within a few calls.
		var recs []lock.Record
		req := lock.ListRequest{Prefix: prefix}
		for range overviewCalls {
			req.Scan = overviewScan - sc.Read
			page, err := l.List(ctx, req)
			if err != nil {
				sc.Err = fmt.Sprintf("%s: %v", c.storeName(), err)
				break
			}
			recs = append(recs, page.Records...)
			sc.Read += page.Scanned
			req.Cursor, sc.All = page.Next, page.Next == ""
			if sc.All || sc.Read >= overviewScan {
				break
			}
		}
		if sc.Err != "" {
			out = append(out, sc)
			continue
		}
		for _, rec := range recs {
			h := health(rec, c.cfg.LeaseTTL)
			switch {
			case rec.State == lock.StateFailed:
				sc.Failed++
			case h.Expired:
				sc.Expired++
			case h.Stalled:
				sc.Stalled++
			case rec.State == lock.StateInProgress:
				sc.InProgress++
			case rec.State == lock.StateCompleted:
				sc.Completed++
			default:
				sc.Other++
			}
		}
		out = append(out, sc)
	}
	return out
}

// stagedLeft says how many of the messages staged in value, a completed
// record's, are not published ("2 pending, 1 returned"), or "" when
// none is; a value whose staged messages cannot be read says so.
func stagedLeft(value []byte) string {
	msgs, err := amqpidem.StoredOutbox(value)
	if err != nil {
		return "unreadable: " + err.Error()
	}
	pending, returned := 0, 0
	for _, m := range msgs {
		switch m.State {
		case amqpidem.OutboxPending:
			pending++
		case amqpidem.OutboxReturned:
			returned++
		}
	}
	switch {
	case pending > 0 && returned > 0:
		return fmt.Sprintf("%d pending, %d returned", pending, returned)
	case pending > 0:
		return fmt.Sprintf("%d pending", pending)
	case returned > 0:
		return fmt.Sprintf("%d returned", returned)
	}
	return ""
}
