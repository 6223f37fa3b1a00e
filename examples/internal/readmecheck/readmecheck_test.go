package readmecheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// programs returns the Go code blocks of page that are whole programs
// (they start with a package clause), by their first line's number.
func programs(t *testing.T, page string) map[int]string {
	t.Helper()
	b, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	found := map[int]string{}
	var block []string
	start, in := 0, false
	for i, line := range strings.Split(string(b), "\n") {
		switch {
		case !in && line == "```go":
			in, start, block = true, i+2, nil
		case in && line == "```":
			in = false
			if len(block) > 0 && strings.HasPrefix(block[0], "package ") {
				found[start] = strings.Join(block, "\n") + "\n"
			}
		case in:
			block = append(block, line)
		}
	}
	return found
}

// TestHtrialREADMEProgramsCompile: every whole program in README.md and
// docs/*.md compiles (go vet type-checks it as a package of its own, in
// this module, as a user's fresh module with amqpidem required would).
// The README's quick start must be among them.
func TestHtrialREADMEProgramsCompile(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append([]string{filepath.Join(root, "README.md")}, pages...)
	n := 0
	for _, page := range pages {
		for line, src := range programs(t, page) {
			n++
			name := filepath.Base(page) + ":" + strconv.Itoa(line)
			dir := t.TempDir()
			file := filepath.Join(dir, "main.go")
			if err := os.WriteFile(file, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("go", "vet", file)
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Errorf("the program at %s does not compile (or vet): %v\n%s", name, err, out)
			}
		}
	}
	if len(programs(t, filepath.Join(root, "README.md"))) == 0 {
		t.Fatal("README.md shows no whole program: the quick start is gone or no longer starts with its package clause")
	}
	t.Logf("%d programs compiled", n)
}
