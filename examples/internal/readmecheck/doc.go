// Package readmecheck holds the test that the whole programs shown in
// README.md and docs/*.md (their Go code blocks that start with a package
// clause) compile as they stand, as the README says of its quick start.
package readmecheck
