// Package pagebench holds the console's page benchmark against 100,000
// records in Redis and in PostgreSQL (BenchmarkPage100k). It is a package
// of its own so that the console's tests import neither pgstore nor pgx:
// a module importing the console gets checksums for its tests'
// dependencies in go.sum (go mod tidy records them), and the console's
// users need no PostgreSQL driver.
//
// Run it with: go test ./console/internal/pagebench -run '^$' -bench BenchmarkPage100k -benchtime 200x
package pagebench
