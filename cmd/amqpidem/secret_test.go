package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// runCLI runs the command line in process, for tests that reach no
// service.
func runCLI(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(context.Background(), args, &out, &errb)
	return out.String(), errb.String(), code
}

// TestHelpHidesEnvironmentCredentials: --help shows no password that a
// flag's default took from the environment.
func TestHelpHidesEnvironmentCredentials(t *testing.T) {
	t.Setenv("AMQPIDEM_AMQP_URL", "amqp://app:amqp-s3cret@rabbit:5672/")
	t.Setenv("AMQPIDEM_REDIS_URL", "redis://:redis-s3cret@redis:6379/0")
	t.Setenv("AMQPIDEM_POSTGRES_DSN", "postgres://app:pg-s3cret@db/app")
	t.Setenv("AMQPIDEM_DYNAMODB_ENDPOINT", "http://key:dynamo-s3cret@dynamo:8000")
	t.Setenv("AMQPIDEM_CONSOLE_TOKEN", "console-s3cret-0123456789")
	for _, args := range [][]string{{"--help"}, {"dlq", "list", "--help"}, {"relay", "--help"}, {"console", "--help"}} {
		out, errOut, code := runCLI(t, args...)
		if code != 0 {
			t.Errorf("%v: exit %d\n%s", args, code, errOut)
		}
		for _, pass := range []string{"amqp-s3cret", "redis-s3cret", "pg-s3cret", "dynamo-s3cret", "console-s3cret"} {
			if strings.Contains(out+errOut, pass) {
				t.Errorf("%v prints the password %q:\n%s", args, pass, out+errOut)
			}
		}
		if !strings.Contains(out, "(from AMQPIDEM_AMQP_URL)") {
			t.Errorf("%v does not say where --amqp's default comes from:\n%s", args, out)
		}
	}
}

// TestMalformedURLErrorsHidePassword: a --amqp, --redis, --postgres or
// --dynamodb-endpoint
// whose password has an unescaped '%', '#' or '/' is refused with the URL
// redacted and nothing of the password, which the parsers' errors quote.
func TestMalformedURLErrorsHidePassword(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss"} {
		for _, tc := range []struct {
			args   []string
			redact string
		}{
			{[]string{"dlq", "list", "q.dlq", "--amqp", "amqp://guest:" + pass + "@127.0.0.1:5672/"}, "amqp://guest:xxxxx@127.0.0.1:5672/"},
			{[]string{"inspect", "k", "--queue", "q", "--redis", "redis://guest:" + pass + "@127.0.0.1:6379/0"}, "redis://guest:xxxxx@127.0.0.1:6379/0"},
			{[]string{"inspect", "k", "--queue", "q", "--postgres", "postgres://guest:" + pass + "@127.0.0.1:1/db"}, ""},
			{[]string{"inspect", "k", "--queue", "q", "--timeout", "3s", "--dynamodb-table", "tab",
				"--dynamodb-endpoint", "http://k:" + pass + "@127.0.0.1:1"}, "http://k:xxxxx@127.0.0.1:1"},
		} {
			_, errOut, code := runCLI(t, tc.args...)
			t.Logf("%v: exit %d: %s", tc.args[:2], code, strings.TrimSpace(errOut))
			if code == 0 {
				t.Errorf("%v: exit 0", tc.args)
			}
			if strings.Contains(errOut, pass) || strings.Contains(errOut, `":p"`) || strings.Contains(errOut, `"%zz"`) ||
				strings.Contains(errOut, "ss@") {
				t.Errorf("%v: the error quotes the password: %s", tc.args, errOut)
			}
			if tc.redact != "" && !strings.Contains(errOut, tc.redact) {
				t.Errorf("%v: the error does not name the URL redacted (%s): %s", tc.args, tc.redact, errOut)
			}
		}
	}
}
