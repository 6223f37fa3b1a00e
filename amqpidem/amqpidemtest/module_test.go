package amqpidemtest_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestFreshModule builds and tests, in a module of its own that requires
// this checkout, what a new user copies from examples/checkout: a
// handler with middleware (amqpidem.Chain), an error-aware retry delay
// (Config.RetryDelay, amqpidem.RetryAfter), two queues in one
// amqpidem.Group (main.go), and its test written with this kit
// (charge_test.go), importing public packages only.
func TestFreshModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module: not in -short")
	}
	_, file, _, _ := runtime.Caller(0)
	root, err := filepath.Abs(filepath.Join(filepath.Dir(file), "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, name := range []string{"main.go", "charge_test.go"} {
		src, err := os.ReadFile(filepath.Join(root, "examples", "checkout", name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), src, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("mod", "init", "example.com/checkout")
	run("mod", "edit", "-require", "github.com/amqpidem/amqpidem@v0.0.0", "-replace", "github.com/amqpidem/amqpidem="+root)
	run("mod", "tidy")
	run("vet", "./...")
	out := run("test", "-count=1", "-v", "./...")
	if !strings.Contains(out, "--- PASS: TestCharge") {
		t.Fatalf("the user's test did not pass:\n%s", out)
	}
}
