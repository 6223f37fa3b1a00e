package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/operator"
	"github.com/amqpidem/amqpidem/lock"
)

// Actions carries out the changes the console's confirmation pages offer:
// forgetting a failed record and replaying a dead letter. The console
// decides nothing itself: it asks for a dry run to show on a confirmation
// page, and on the operator's confirmation (a POST carrying the page's
// CSRF token) for the action, and shows and logs what the Outcome says.
// The rules (what may be forgotten or replayed) are the implementation's:
// "amqpidem console" gives the command's own. With Config.Actions nil the
// console is read-only.
type Actions interface {
	// Forget forgets the record of Key of Endpoint if it is a failed
	// record with Fence: the one the operator was shown.
	Forget(ctx context.Context, req ForgetRequest) Outcome
	// Replay publishes the dead letters of Key in DLQ back to Queue, as
	// "amqpidem dlq replay QUEUE --key KEY [--forget]" does.
	Replay(ctx context.Context, req ReplayRequest) Outcome
}

// ForgetRequest asks Actions.Forget to forget a failed record.
type ForgetRequest struct {
	Endpoint, Key string
	// Fence is the fence of the failed record shown to the operator:
	// any other record is left.
	Fence int64
	// DryRun asks what would be done; nothing is changed.
	DryRun bool
}

// ReplayRequest asks Actions.Replay to replay the dead letters of a key.
type ReplayRequest struct {
	// Queue is where the dead letters are published back to; DLQ is the
	// dead-letter queue they are in ("": Queue.dlq).
	Queue, DLQ, Key string
	// Forget forgets a failed record of the key first, so that the
	// handler runs again.
	Forget bool
	// DryRun asks what would be done; nothing is changed.
	DryRun bool
}

// Status is how an action ended.
type Status int

// The statuses of an Outcome.
const (
	// Done: it did, or under DryRun would do, what was asked.
	Done Status = iota + 1
	// Refused: a rule left it undone (nothing found, a record not
	// failed or changed meanwhile, a dead letter a replay cannot help);
	// the report says why.
	Refused
	// Failed: a service failed; the report says what was done.
	Failed
)

// String is the status in a word: done, refused or failed.
func (s Status) String() string {
	switch s {
	case Done:
		return "done"
	case Refused:
		return "refused"
	case Failed:
		return "failed"
	}
	return "status " + strconv.Itoa(int(s))
}

// Outcome is what an action did or would do.
type Outcome struct {
	Status Status
	// Report says it for people, in lines; the console shows it escaped.
	Report string
}

// csrfCookie holds the random value a confirmation page's CSRF token is
// made from.
const csrfCookie = "amqpidem_console_csrf"

// csrfToken is the CSRF token for the browser of r, setting its cookie
// when it has none: an HMAC of the cookie's random value under the
// console's key, which a page of another origin can neither read nor
// make.
func (c *Console) csrfToken(w http.ResponseWriter, r *http.Request) string {
	v := ""
	if ck, err := r.Cookie(csrfCookie); err == nil && len(ck.Value) == 64 {
		v = ck.Value
	} else {
		b := make([]byte, 32)
		rand.Read(b)
		v = hex.EncodeToString(b)
		http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: v, Path: "/", HttpOnly: true,
			SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
	}
	return c.csrfMAC(v)
}

func (c *Console) csrfMAC(v string) string {
	m := hmac.New(sha256.New, c.csrfKey[:])
	m.Write([]byte(v))
	return hex.EncodeToString(m.Sum(nil))
}

// checkPost refuses a POST that did not come from a confirmation page of
// this console in this browser: one from another origin (Sec-Fetch-Site,
// Origin) or without the token the page carried.
func (c *Console) checkPost(r *http.Request) *problem {
	refused := &problem{Status: http.StatusForbidden, Title: "Not confirmed here",
		What: "This request did not come from one of this console's confirmation pages: nothing was changed.",
		Do:   "Go back, reload the confirmation page and confirm again.", Overview: true}
	if err := c.origins.Check(r); err != nil {
		return refused
	}
	ck, err := r.Cookie(csrfCookie)
	if err != nil {
		return refused
	}
	got, err := hex.DecodeString(r.PostFormValue("csrf"))
	want, _ := hex.DecodeString(c.csrfMAC(ck.Value))
	if err != nil || !hmac.Equal(got, want) {
		return refused
	}
	return nil
}

// confirmation is a confirmation page, or the page of an action's result.
type confirmation struct {
	page
	Heading string
	// Means says what the action means, before its dry run's report.
	Means []string
	// Report is the dry run's (or the action's) report, in escaped lines.
	Report []string
	Status Status
	// Action is where the confirmation posts ("" when there is nothing
	// to confirm), with Fields as hidden inputs and CSRF.
	Action string
	Fields []field
	CSRF   string
	Button string
	// Others are links to other pages: back, or another action.
	Others []link
	Result bool
}

// field is a hidden input of a confirmation. Its value is hex: a key can
// hold any byte, which a form would change (browsers turn a lone newline
// into CR LF) and a page must not carry raw.
type field struct{ Name, Value string }

// hidden is the field name with value, hex-encoded.
func hidden(name, value string) field { return field{name, hex.EncodeToString([]byte(value))} }

// posted is the value of the hidden field name of a confirmation ("" when
// it is missing or not hex).
func posted(r *http.Request, name string) string {
	b, err := hex.DecodeString(r.PostFormValue(name))
	if err != nil {
		return ""
	}
	return string(b)
}

type link struct{ Href, Text string }

// lines is report split into lines, each escaped.
func lines(report string) []string {
	report = strings.TrimRight(report, "\n")
	if report == "" {
		return nil
	}
	out := strings.Split(report, "\n")
	for i, l := range out {
		out[i] = operator.Escape(l)
	}
	return out
}

// readOnly answers an action's page when the console has no Actions.
func (c *Console) readOnly(w http.ResponseWriter, r *http.Request) bool {
	if c.cfg.Actions != nil {
		return false
	}
	c.problem(w, r, &problem{Status: http.StatusForbidden, Title: "Read-only",
		What: "This console was started read-only: it changes nothing.",
		Do:   "Run the command the page names, or start the console without --read-only.", Overview: true})
	return true
}

// forgetForm is GET /forget: what forgetting the failed record of a key
// means and what a dry run says, with the button that confirms it.
func (c *Console) forgetForm(w http.ResponseWriter, r *http.Request) {
	if c.readOnly(w, r) {
		return
	}
	q := r.URL.Query()
	endpoint, key := q.Get("endpoint"), q.Get("key")
	rec, ok := c.record(w, r, endpoint, key)
	if !ok {
		return
	}
	back := link{"key?" + url.Values{"endpoint": {endpoint}, "key": {key}}.Encode(), "Back to the record"}
	if rec.State != lock.StateFailed {
		c.problem(w, r, &problem{Status: http.StatusConflict, Title: "Not a failed record",
			What: fmt.Sprintf("The record of key %q of %s is %s: the console forgets only failed records.", key, endpoint, rec.State),
			Do:   "Use the command's forget for others; it says what it refuses and why.", Overview: true})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	out := c.cfg.Actions.Forget(ctx, ForgetRequest{Endpoint: endpoint, Key: key, Fence: rec.Fence, DryRun: true})
	p := confirmation{page: c.page("forget " + operator.Escape(key) + "?"), Heading: "Forget the failed record of " + operator.Escape(key) + "?",
		Means: []string{
			"Forgetting deletes this failed record (attempts " + strconv.Itoa(rec.Attempts) + ", fence " + strconv.FormatInt(rec.Fence, 10) + "), and only it: if the record changed since this page was made, nothing is deleted.",
			"The next delivery of the key then runs the handler again, as a first execution: fix the cause of the failure first.",
			"Its dead letter, if any, stays in the dead-letter queue: replay it (with forget) to run it again now.",
		},
		Report: lines(out.Report), Status: out.Status, Others: []link{back}}
	if out.Status == Done {
		p.Action, p.Button, p.CSRF = "forget", "Forget this record", c.csrfToken(w, r)
		p.Fields = []field{hidden("endpoint", endpoint), hidden("key", key), hidden("fence", strconv.FormatInt(rec.Fence, 10))}
	}
	c.render(w, r, http.StatusOK, "confirm.html", p)
}

// forget is POST /forget: the confirmed forget.
func (c *Console) forget(w http.ResponseWriter, r *http.Request) {
	if c.readOnly(w, r) {
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if p := c.checkPost(r); p != nil {
		c.problem(w, r, p)
		return
	}
	endpoint, key := posted(r, "endpoint"), posted(r, "key")
	fence, err := strconv.ParseInt(posted(r, "fence"), 10, 64)
	if endpoint == "" || key == "" || err != nil {
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Incomplete confirmation",
			What: "The confirmation lacks the endpoint, the key or the record's fence: nothing was changed.",
			Do:   "Go back to the record and start again.", Overview: true})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	out := c.cfg.Actions.Forget(ctx, ForgetRequest{Endpoint: endpoint, Key: key, Fence: fence})
	c.cfg.Logger.Info("amqpidem console: action", "action", "forget", "endpoint", operator.Escape(endpoint), "key", operator.Escape(key),
		"fence", fence, "status", out.Status.String(), "report", operator.Escape(strings.TrimSpace(out.Report)), "remote", r.RemoteAddr)
	c.result(w, r, "Forget "+operator.Escape(key), out, link{"key?" + url.Values{"endpoint": {endpoint}, "key": {key}}.Encode(), "The record now"})
}

// replayForm is GET /replay: what replaying the dead letters of a key
// means (with forget: what forgetting means) and what a dry run says,
// with the button that confirms it.
func (c *Console) replayForm(w http.ResponseWriter, r *http.Request) {
	if c.readOnly(w, r) {
		return
	}
	q := r.URL.Query()
	req := ReplayRequest{Queue: q.Get("queue"), DLQ: q.Get("dlq"), Key: q.Get("key"), Forget: q.Get("forget") == "1", DryRun: true}
	if p := replayInput(req); p != nil {
		c.problem(w, r, p)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	out, p := c.replay(ctx, req)
	if p != nil {
		c.problem(w, r, p)
		return
	}
	dlq := req.DLQ
	if dlq == "" {
		dlq = req.Queue + ".dlq"
	}
	heading := "Replay the dead letters of " + operator.Escape(req.Key) + "?"
	means := []string{
		"Replaying publishes each dead letter of this key in " + operator.Escape(dlq) + " back to " + operator.Escape(req.Queue) +
			" with confirms, and removes it from the dead-letter queue only once its copy is confirmed.",
		"Dead letters a replay cannot help (work completed, no key, a failed record without forget) are left, and the report says why.",
	}
	if req.Forget {
		heading = "Forget the failed record of " + operator.Escape(req.Key) + " and replay its dead letters?"
		means = append(means, "With forget, the key's failed record is deleted first (only a failed one, and only signed dead letters are trusted for it): "+
			"the replayed message then runs the handler again, as a first execution. Fix the cause of the failure first.")
	}
	v := url.Values{"queue": {req.Queue}, "key": {req.Key}}
	if req.DLQ != "" {
		v.Set("dlq", req.DLQ)
	}
	p2 := confirmation{page: c.page("replay " + operator.Escape(req.Key) + "?"), Heading: heading, Means: means,
		Report: lines(out.Report), Status: out.Status,
		Others: []link{{"dlq?" + url.Values{"queue": {req.Queue}, "dlq": {req.DLQ}}.Encode(), "Back to the dead letters"}}}
	if !req.Forget {
		v.Set("forget", "1")
		p2.Others = append(p2.Others, link{"replay?" + v.Encode(), "Replay with forget: see what it would do"})
		v.Del("forget")
	}
	if out.Status == Done {
		p2.Action, p2.CSRF = "replay", c.csrfToken(w, r)
		p2.Button = "Replay"
		p2.Fields = []field{hidden("queue", req.Queue), hidden("dlq", req.DLQ), hidden("key", req.Key)}
		if req.Forget {
			p2.Button = "Forget the failed record and replay"
			p2.Fields = append(p2.Fields, hidden("forget", "1"))
		}
	}
	c.render(w, r, http.StatusOK, "confirm.html", p2)
}

// replay is POST /replay: the confirmed replay.
func (c *Console) replayPost(w http.ResponseWriter, r *http.Request) {
	if c.readOnly(w, r) {
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if p := c.checkPost(r); p != nil {
		c.problem(w, r, p)
		return
	}
	req := ReplayRequest{Queue: posted(r, "queue"), DLQ: posted(r, "dlq"), Key: posted(r, "key"), Forget: posted(r, "forget") == "1"}
	if p := replayInput(req); p != nil {
		c.problem(w, r, p)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	out, p := c.replay(ctx, req)
	if p != nil {
		c.problem(w, r, p)
		return
	}
	c.cfg.Logger.Info("amqpidem console: action", "action", "replay", "queue", operator.Escape(req.Queue), "dlq", operator.Escape(req.DLQ),
		"key", operator.Escape(req.Key), "forget", req.Forget, "status", out.Status.String(), "report", operator.Escape(strings.TrimSpace(out.Report)),
		"remote", r.RemoteAddr)
	c.result(w, r, "Replay "+operator.Escape(req.Key), out,
		link{"dlq?" + url.Values{"queue": {req.Queue}, "dlq": {req.DLQ}}.Encode(), "The dead letters now"},
		link{"key?" + url.Values{"endpoint": {req.Queue}, "key": {req.Key}}.Encode(), "The record now"})
}

// replay runs Actions.Replay in the dead-letter queues' turn (a page
// reading one meanwhile would see only part of it).
func (c *Console) replay(ctx context.Context, req ReplayRequest) (Outcome, *problem) {
	select {
	case c.dlqTurn <- struct{}{}:
		defer func() { <-c.dlqTurn }()
	case <-ctx.Done():
		return Outcome{}, &problem{Status: http.StatusServiceUnavailable, Title: "Busy",
			What: "Another page was reading a dead-letter queue until the timeout: nothing was changed.", Do: "Try again.", Overview: true}
	}
	return c.cfg.Actions.Replay(ctx, req), nil
}

// replayInput checks a replay's parameters.
func replayInput(req ReplayRequest) *problem {
	if req.Queue == "" || req.Key == "" || len(req.Queue) > 255 || len(req.DLQ) > 255 || len(req.Key) > lock.MaxKeyLen {
		return &problem{Status: http.StatusBadRequest, Title: "Which dead letters?",
			What: "A replay needs the queue and the key of its dead letters.",
			Do:   "Start from the queue's dead letters and choose Replay on one.", Overview: true}
	}
	return nil
}

// result shows what an action did, with the status code that fits.
func (c *Console) result(w http.ResponseWriter, r *http.Request, heading string, out Outcome, others ...link) {
	status := http.StatusOK
	switch out.Status {
	case Refused:
		status = http.StatusConflict
	case Failed:
		status = http.StatusServiceUnavailable
	}
	c.render(w, r, status, "confirm.html", confirmation{page: c.page(heading), Heading: heading + ": " + out.Status.String(),
		Report: lines(out.Report), Status: out.Status, Others: others, Result: true})
}

// record reads the record of key for an action's page; ok is false when
// a problem page was written instead.
func (c *Console) record(w http.ResponseWriter, r *http.Request, endpoint, key string) (lock.Record, bool) {
	if endpoint == "" || key == "" || len(key) > lock.MaxKeyLen || len(endpoint) > lock.MaxKeyLen {
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Which key?",
			What: "This page needs the consumer's endpoint and the message's key.", Do: "Start from the key's record.", Overview: true})
		return lock.Record{}, false
	}
	if c.cfg.Admin == nil {
		c.problem(w, r, &problem{Status: http.StatusServiceUnavailable, Title: "No store",
			What: "This console was given no store to read records from.", Do: "Give it the consumers' store.", Overview: true})
		return lock.Record{}, false
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	skey := amqpidem.StoreKey(endpoint, key)
	rec, err := c.cfg.Admin.Inspect(ctx, skey)
	if err != nil {
		c.problem(w, r, c.recordProblem(r, endpoint, key, skey, err))
		return lock.Record{}, false
	}
	return rec, true
}
