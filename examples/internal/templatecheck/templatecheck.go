// Package templatecheck checks that an example's main.go is a template a
// user can copy whole into a module of their own: it imports only the
// standard library, the module's public packages and the module's
// dependencies, and it compiles alone, without the example's other files.
package templatecheck

import (
	"go/parser"
	"go/token"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/amqpidem/amqpidem"

// public are the module's packages a template may import.
var public = map[string]bool{
	module + "/amqpidem":     true,
	module + "/lock":         true,
	module + "/heartbeat":    true,
	module + "/pgstore":      true,
	module + "/promamqpidem": true,
}

// Check fails t unless file, in the current directory, is a template.
func Check(t *testing.T, file string) {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		internal := path == "internal" || strings.HasPrefix(path, "internal/") ||
			strings.HasSuffix(path, "/internal") || strings.Contains(path, "/internal/")
		ours := path == module || strings.HasPrefix(path, module+"/")
		if internal || (ours && !public[path]) {
			t.Errorf("%s imports %s, which a copy in another module cannot import", file, path)
		}
	}
	// go vet type-checks file as a package of its own.
	out, err := exec.Command("go", "vet", file).CombinedOutput()
	if err != nil {
		t.Errorf("%s does not compile (or vet) alone: %v\n%s", file, err, out)
	}
}
