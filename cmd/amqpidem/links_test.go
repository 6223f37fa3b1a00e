package main_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestDocLinks: every relative link in README.md and docs/*.md (and the
// pages they are kept with, test/chaos/README.md) names a file or
// directory of the repository, and a link with an anchor names a heading
// of its Markdown page, as GitHub spells heading anchors. Links to other
// sites are not followed. This lives with the transcript tests because
// those already read the pages; it needs no service.
func TestDocLinks(t *testing.T) {
	root := "../.."
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, filepath.Join(root, "README.md"), filepath.Join(root, "test", "chaos", "README.md"))
	anchors := map[string]map[string]bool{} // page path -> its anchors
	anchorsOf := func(path string) map[string]bool {
		if a, ok := anchors[path]; ok {
			return a
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		anchors[path] = headingAnchors(string(b))
		return anchors[path]
	}
	checked := 0
	for _, page := range pages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range markdownLinks(string(b)) {
			target, anchor, _ := strings.Cut(l.target, "#")
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			checked++
			path := page
			if target != "" {
				path = filepath.Join(filepath.Dir(page), filepath.FromSlash(target))
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s:%d: link to %s: no such file", rel(root, page), l.line, l.target)
					continue
				}
			}
			if anchor != "" && strings.HasSuffix(path, ".md") && !anchorsOf(path)[anchor] {
				t.Errorf("%s:%d: link to %s: %s has no heading with anchor #%s", rel(root, page), l.line, l.target, rel(root, path), anchor)
			}
		}
	}
	if checked == 0 {
		t.Fatal("found no relative link at all: the parser is broken")
	}
}

// rel is path relative to root, for messages.
func rel(root, path string) string {
	if r, err := filepath.Rel(root, path); err == nil {
		return filepath.ToSlash(r)
	}
	return path
}

// link is one Markdown link: its target and the line it is on.
type link struct {
	target string
	line   int
}

var (
	linkRE       = regexp.MustCompile(`\]\(([^()\s]+)(?:\s+"[^"]*")?\)`)
	inlineCodeRE = regexp.MustCompile("`[^`]*`")
)

// markdownLinks returns the inline links of a Markdown text, outside
// fenced code blocks and inline code.
func markdownLinks(text string) []link {
	var links []link
	fenced := false
	for i, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced {
			continue
		}
		line = inlineCodeRE.ReplaceAllStringFunc(line, func(code string) string {
			// Keep a link whose text is inline code, [`x`](y): drop the code only.
			return strings.Repeat("x", len(code))
		})
		for _, m := range linkRE.FindAllStringSubmatch(line, -1) {
			links = append(links, link{target: m[1], line: i + 1})
		}
	}
	return links
}

var (
	headingLinkRE = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)
	notSlugRE     = regexp.MustCompile(`[^\p{L}\p{N} _-]`)
)

// headingAnchors returns the anchors GitHub gives the headings of a
// Markdown text: lower case, punctuation dropped, spaces as hyphens, and
// -1, -2... on repeats.
func headingAnchors(text string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	fenced := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced || !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimSpace(strings.TrimLeft(line, "#"))
		title = headingLinkRE.ReplaceAllString(title, "$1")
		slug := strings.ReplaceAll(notSlugRE.ReplaceAllString(strings.ToLower(title), ""), " ", "-")
		if n := seen[slug]; n > 0 {
			anchors[slug+"-"+strconv.Itoa(n)] = true
		} else {
			anchors[slug] = true
		}
		seen[slug]++
	}
	return anchors
}
