package linearizable

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Result is the outcome of checking one history.
type Result struct {
	// Name names the store and fault, as in "redis-kill9".
	Name string
	// Ops, Keys and Clients describe the history.
	Ops, Keys, Clients int
	// Ambiguous counts operations whose answer was lost; Other those of
	// them with an error no store documents (see ErrOther).
	Ambiguous, Other int
	// Check is porcupine's verdict: Ok, Illegal (a violation) or Unknown
	// (the time budget ran out first).
	Check porcupine.CheckResult
	// Checked is how long the check took.
	Checked time.Duration
	// Visualization is the HTML file of the failing partition, written on
	// a violation; History the JSON file of the whole history.
	Visualization, History string
}

// Summary counts the operations of a history by kind and answer, as in
// "acquire:acquired=310 complete:ok=120 complete:lease_lost=14", so that a
// run shows what it exercised.
func Summary(history []Op) string {
	counts := map[string]int{}
	for _, op := range history {
		answer := string(op.Out.Err)
		switch {
		case answer != "":
		case op.In.Kind == KindAcquire:
			answer = op.Out.Status.String()
		case op.In.Kind == KindInspect:
			answer = string(op.Out.State)
		default:
			answer = "ok"
		}
		counts[string(op.In.Kind)+":"+answer]++
	}
	names := make([]string, 0, len(counts))
	for n := range counts {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for i, n := range names {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s=%d", n, counts[n])
	}
	return b.String()
}

// Verdict is "ok", "violation" or "unknown" (budget exhausted).
func (r Result) Verdict() string {
	switch r.Check {
	case porcupine.Ok:
		return "ok"
	case porcupine.Illegal:
		return "violation"
	}
	return "unknown"
}

// String is the line the tests print for the result.
func (r Result) String() string {
	return fmt.Sprintf("linearizable %s ops=%d keys=%d clients=%d result=%s checked_ms=%d",
		r.Name, r.Ops, r.Keys, r.Clients, r.Verdict(), r.Checked.Milliseconds())
}

// Check checks history against the model of a store with clock p, for
// at most budget. On a violation it writes the history as JSON to
// dir/<name>.json (ReadHistory reads it back) and porcupine's
// visualization of it to dir/<name>.html, the failing partition marked
// (dir is made if missing; "" writes nothing).
func Check(name string, p Params, history []Op, clients int, budget time.Duration, dir string) (Result, error) {
	res := Result{Name: name, Ops: len(history), Clients: clients}
	keys := map[string]bool{}
	var end int64
	for _, op := range history {
		keys[op.In.Key] = true
		end = max(end, op.Out.Return)
	}
	res.Keys = len(keys)
	ops := make([]porcupine.Operation, len(history))
	for i, op := range history {
		ret := op.Out.Return
		if ambiguous(op.Out.Err) {
			// It may take effect at any time from its call on.
			ret = end + 1
			res.Ambiguous++
			if op.Out.Err == ErrOther {
				res.Other++
			}
		}
		ops[i] = porcupine.Operation{ClientId: op.Client, Input: op.In, Call: op.In.Call, Output: op.Out, Return: ret}
	}
	model := Model(p)
	start := time.Now()
	verdict, info := porcupine.CheckOperationsVerbose(model, ops, budget)
	res.Checked, res.Check = time.Since(start), verdict
	if dir == "" || verdict != porcupine.Illegal {
		return res, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return res, err
	}
	res.History = filepath.Join(dir, name+".json")
	b, err := json.Marshal(history)
	if err != nil {
		return res, err
	}
	if err := os.WriteFile(res.History, b, 0o644); err != nil {
		return res, err
	}
	res.Visualization = filepath.Join(dir, name+".html")
	return res, porcupine.VisualizePath(model, info, res.Visualization)
}

// ReadHistory reads a history that Check wrote, to check it again.
func ReadHistory(path string) ([]Op, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var ops []Op
	return ops, json.Unmarshal(b, &ops)
}

// Explain describes the violations of history, key by key: for each key
// whose operations are not linearizable, the last 8 operations of the longest
// sequence of them the model accepts, with the model's states after each, then the pending
// operations (in call order) none of which it accepts next. It is for
// reading a history that Check found not linearizable.
func Explain(p Params, history []Op, budget time.Duration) string {
	model := Model(p)
	var end int64
	for _, op := range history {
		end = max(end, op.Out.Return)
	}
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range history {
		ret := op.Out.Return
		if ambiguous(op.Out.Err) {
			ret = end + 1
		}
		if _, ok := byKey[op.In.Key]; !ok {
			keys = append(keys, op.In.Key)
		}
		byKey[op.In.Key] = append(byKey[op.In.Key], porcupine.Operation{ClientId: op.Client, Input: op.In, Call: op.In.Call, Output: op.Out, Return: ret})
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		ops := byKey[k]
		verdict, info := porcupine.CheckOperationsVerbose(model, ops, budget)
		if verdict != porcupine.Illegal {
			continue
		}
		var longest []int
		for _, part := range info.PartialLinearizations() {
			for _, lin := range part {
				if len(lin) > len(longest) {
					longest = lin
				}
			}
		}
		fmt.Fprintf(&b, "key %q: %d operations, longest linearizable prefix %d:\n", k, len(ops), len(longest))
		st := model.Init()
		done := map[int]bool{}
		for n, i := range longest {
			_, st = model.Step(st, ops[i].Input, ops[i].Output)
			done[i] = true
			if n < len(longest)-8 {
				continue // the last 8 only
			}
			fmt.Fprintf(&b, "  c%d [%v,%v] %s\n      ⇒ %s\n", ops[i].ClientId, time.Duration(ops[i].Call), time.Duration(ops[i].Return),
				model.DescribeOperation(ops[i].Input, ops[i].Output), model.DescribeState(st))
		}
		var rest []int
		for i := range ops {
			if !done[i] {
				rest = append(rest, i)
			}
		}
		sort.Slice(rest, func(a, c int) bool { return ops[rest[a]].Call < ops[rest[c]].Call })
		fmt.Fprintf(&b, "  then none of:\n")
		for n, i := range rest {
			if n == 6 {
				break
			}
			fmt.Fprintf(&b, "  c%d [%v,%v] %s\n", ops[i].ClientId, time.Duration(ops[i].Call), time.Duration(ops[i].Return),
				model.DescribeOperation(ops[i].Input, ops[i].Output))
		}
	}
	return b.String()
}
