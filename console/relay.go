package console

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/amqpidem/amqpidem/internal/operator"
)

// Relay reads a producer outbox for the relay page: pgstore's Outbox
// ("amqpidem console" adapts it; the console does not import pgstore, so
// that mounting it pulls in no database driver).
type Relay interface {
	// Backlog is how many rows wait to be published and how long the
	// oldest has waited.
	Backlog(ctx context.Context) (pending int64, oldest time.Duration, err error)
	// Dead is how many rows the broker refused too often to try again.
	Dead(ctx context.Context) (int64, error)
	// Rows returns up to limit rows in state ("pending" or "dead") in ID
	// order, after the row with ID after (0: from the first).
	Rows(ctx context.Context, state string, after int64, limit int) ([]RelayRow, error)
}

// RelayRow is a row of the outbox as the relay page shows it.
type RelayRow struct {
	// ID is the row's, in the order rows were written.
	ID int64
	// MessageID, Exchange and RoutingKey are the stored message's; shown
	// escaped.
	MessageID, Exchange, RoutingKey string
	// Attempts counts the publishes the broker refused; LastError is the
	// last refusal.
	Attempts  int
	LastError string
	// CreatedAt is when the row was written.
	CreatedAt time.Time
	// Unreadable says why the stored message could not be read ("" when
	// it could).
	Unreadable string
}

// Redriver is the action of making a dead outbox row pending again, for
// a relay to publish. Config.Actions may implement it; the relay page
// offers redrive only when it does.
type Redriver interface {
	// Redrive makes the dead row with req.ID pending again, as "amqpidem
	// relay redrive ID" does; a row that is not dead is refused.
	Redrive(ctx context.Context, req RedriveRequest) Outcome
}

// RedriveRequest asks Redriver.Redrive to make a dead row pending again.
type RedriveRequest struct {
	// ID is the dead row's.
	ID int64
	// DryRun asks what would be done; nothing is changed.
	DryRun bool
}

// relayPage is how many rows the relay page shows.
const relayPage = 50

// relayStatus is the outbox's backlog as the overview and the relay page
// show it.
type relayStatus struct {
	// Name is Config.RelayName, or "the outbox".
	Name    string
	Pending int64
	Oldest  string
	Dead    int64
	Err     string
}

// relayStatus reads the outbox's backlog; Err says why it is unknown.
func (c *Console) relayStatus(ctx context.Context, r *http.Request) relayStatus {
	st := relayStatus{Name: c.relayName()}
	n, oldest, err := c.cfg.Relay.Backlog(ctx)
	if err == nil {
		st.Pending, st.Oldest = n, oldest.Round(time.Millisecond).String()
		st.Dead, err = c.cfg.Relay.Dead(ctx)
	}
	if err != nil {
		st.Err = fmt.Sprintf("%s: %v", c.relayName(), err)
		c.cfg.Logger.Warn("amqpidem console: a service failed", "path", r.URL.Path, "service", "outbox", "err", err)
	}
	return st
}

func (c *Console) relayName() string {
	if c.cfg.RelayName != "" {
		return c.cfg.RelayName
	}
	return "the outbox"
}

// redriver is Config.Actions' Redriver, or nil.
func (c *Console) redriver() Redriver {
	rd, _ := c.cfg.Actions.(Redriver)
	return rd
}

// relay is GET /relay[?state=dead|pending][&after=ID]: the outbox's
// backlog and a page of its dead (or pending) rows, with a link to the
// next page and, for dead rows, to redrive each.
func (c *Console) relay(w http.ResponseWriter, r *http.Request) {
	if c.cfg.Relay == nil {
		c.problem(w, r, &problem{Status: http.StatusServiceUnavailable, Title: "No outbox",
			What: "This console was given no producer outbox to read.",
			Do:   "Give it pgstore's Outbox (Config.Relay; the command's --postgres).", Overview: true})
		return
	}
	q := r.URL.Query()
	state := q.Get("state")
	if state == "" {
		state = "dead"
	}
	if state != "dead" && state != "pending" {
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "No such state",
			What: fmt.Sprintf("state %q is neither dead nor pending.", state), Do: "Pick dead or pending on the relay page.", Overview: true})
		return
	}
	var after int64
	if s := q.Get("after"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Bad row ID",
				What: fmt.Sprintf("after %q is not a row ID (a whole number, 0 or more).", s), Do: "Start from the relay page's first page.", Overview: true})
			return
		}
		after = n
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	st := c.relayStatus(ctx, r)
	if st.Err != "" {
		c.problem(w, r, &problem{Status: http.StatusServiceUnavailable, Title: c.relayName() + " did not answer",
			What: st.Err, Do: "Check that PostgreSQL is up and reachable from this console, then reload.", Overview: true})
		return
	}
	rows, err := c.cfg.Relay.Rows(ctx, state, after, relayPage)
	if err != nil {
		c.problem(w, r, c.failed(r, err, c.relayName(), "Check that PostgreSQL is up and reachable from this console, then reload."))
		return
	}
	data := struct {
		page
		relayStatus
		State, Other string
		Rows         []RelayRow
		Redrive      bool
		Next         string
		Command      string
	}{page: c.page("relay: " + state + " rows"), relayStatus: st, State: state, Rows: rows,
		Redrive: c.redriver() != nil, Command: c.cfg.Commands}
	data.Other = "pending"
	if state == "pending" {
		data.Other = "dead"
	}
	if len(rows) == relayPage {
		data.Next = "relay?" + url.Values{"state": {state}, "after": {strconv.FormatInt(rows[len(rows)-1].ID, 10)}}.Encode()
	}
	c.render(w, r, http.StatusOK, "relay.html", data)
}

// redriveID reads the row ID of a redrive, from the query or the posted
// form; ok is false when a problem page was written instead.
func (c *Console) redriveID(w http.ResponseWriter, r *http.Request, s string) (int64, bool) {
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id <= 0 {
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Which row?",
			What: fmt.Sprintf("%q is not an outbox row ID (a whole number above 0).", s),
			Do:   "Start from the relay page's dead rows and choose Redrive on one.", Overview: true})
		return 0, false
	}
	return id, true
}

// redriveForm is GET /redrive?id=N: what redriving a dead row means and
// what a dry run says, with the button that confirms it.
func (c *Console) redriveForm(w http.ResponseWriter, r *http.Request) {
	if c.readOnly(w, r) {
		return
	}
	rd := c.redriver()
	if rd == nil {
		c.problem(w, r, &problem{Status: http.StatusForbidden, Title: "No redrive here",
			What: "This console's actions do not include redriving outbox rows.",
			Do:   "Run amqpidem relay redrive with the row's ID.", Overview: true})
		return
	}
	id, ok := c.redriveID(w, r, r.URL.Query().Get("id"))
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	out := rd.Redrive(ctx, RedriveRequest{ID: id, DryRun: true})
	sid := strconv.FormatInt(id, 10)
	p := confirmation{page: c.page("redrive row " + sid + "?"), Heading: "Make dead row " + sid + " pending again?",
		Means: []string{
			"Redriving makes this dead row pending again with its attempts reset: a running relay publishes it at once.",
			"Fix what made the broker refuse it first (bind the queue, declare the exchange), or it is dead again after the relay's attempts.",
		},
		Report: lines(out.Report), Status: out.Status, Others: []link{{"relay?state=dead", "Back to the dead rows"}}}
	if out.Status == Done {
		p.Action, p.Button, p.CSRF = "redrive", "Redrive row "+sid, c.csrfToken(w, r)
		p.Fields = []field{hidden("id", sid)}
	}
	c.render(w, r, http.StatusOK, "confirm.html", p)
}

// redrive is POST /redrive: the confirmed redrive.
func (c *Console) redrive(w http.ResponseWriter, r *http.Request) {
	if c.readOnly(w, r) {
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if p := c.checkPost(r); p != nil {
		c.problem(w, r, p)
		return
	}
	rd := c.redriver()
	if rd == nil {
		c.problem(w, r, &problem{Status: http.StatusForbidden, Title: "No redrive here",
			What: "This console's actions do not include redriving outbox rows: nothing was changed.",
			Do:   "Run amqpidem relay redrive with the row's ID.", Overview: true})
		return
	}
	id, ok := c.redriveID(w, r, posted(r, "id"))
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	out := rd.Redrive(ctx, RedriveRequest{ID: id})
	c.cfg.Logger.Info("amqpidem console: action", "action", "redrive", "id", id, "status", out.Status.String(),
		"report", operator.Escape(out.Report), "remote", r.RemoteAddr)
	c.result(w, r, "Redrive row "+strconv.FormatInt(id, 10), out, link{"relay?state=dead", "The dead rows now"},
		link{"relay?state=pending", "The pending rows"})
}
