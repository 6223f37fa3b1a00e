package linearizable

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
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
