package dynamostore_test

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"

	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// privateServer builds the tests' DynamoDB server (scripts/dynamo) and
// starts one of its own on a free loopback port, killed in t.Cleanup, for
// tests that pause it. It returns the process and a client of it.
func privateServer(t *testing.T) (*testenv.Process, *dynamodb.Client) {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("runtime.Caller failed")
	}
	src := filepath.Join(filepath.Dir(file), "..", "scripts", "dynamo")
	bin := filepath.Join(t.TempDir(), "dynamo-server")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = src
	build.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the DynamoDB server of scripts/dynamo: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	p, err := testenv.StartProcess(exec.Command(bin, "-addr", addr), filepath.Join(t.TempDir(), "dynamo.log"), "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.Resume()
		p.Kill()
		if t.Failed() {
			t.Logf("the server's log:\n%s", p.Output())
		}
	})
	client := dynamodb.New(dynamodb.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String("http://" + addr),
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "test", SecretAccessKey: "test"}, nil
		}),
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := dynamostore.CreateTable(ctx, client, dynamostore.Config{})
		cancel()
		if err == nil {
			return p, client
		}
		if time.Now().After(deadline) {
			t.Fatalf("the private DynamoDB server does not answer: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestPausedServer: while DynamoDB does not answer (its process stopped),
// every call ends with the caller's context as lock.ErrUnavailable; once it
// answers again, a retried Complete finds its write or makes it, and the
// store serves on.
func TestPausedServer(t *testing.T) {
	p, client := privateServer(t)
	s, err := dynamostore.New(client, dynamostore.Config{MaxClockSkew: testSkew})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: 10 * time.Second})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %+v, %v", res, err)
	}
	if err := p.Pause(); err != nil {
		t.Fatal(err)
	}
	short := func() context.Context {
		c, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		t.Cleanup(cancel)
		return c
	}
	start := time.Now()
	if err := s.Extend(short(), res.Lease)[0]; !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Extend while paused: got %v, want ErrUnavailable", err)
	}
	if _, err := s.Acquire(short(), lock.Request{Key: "other"}); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Acquire while paused: got %v, want ErrUnavailable", err)
	}
	if err := s.Complete(short(), res.Lease, []byte("ok")); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Complete while paused: got %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("three calls with 300ms contexts took %v", d)
	}
	if err := p.Resume(); err != nil {
		t.Fatal(err)
	}
	// The requests sent during the pause may still be served now: the
	// Complete, for one. Its retry answers nil whether or not it landed.
	if err := s.Complete(ctx, res.Lease, []byte("ok")); err != nil {
		t.Fatalf("Complete retried after the pause: %v", err)
	}
	if got, err := s.Acquire(ctx, lock.Request{Key: "k"}); err != nil || got.Status != lock.Completed || string(got.Value) != "ok" {
		t.Fatalf("Acquire after the pause: %+v, %v; want completed with its result", got, err)
	}
	// The Acquire of "other" that timed out may have taken a lease: the
	// key is in progress or free, never lost.
	if got, err := s.Acquire(ctx, lock.Request{Key: "other"}); err != nil || (got.Status != lock.Acquired && got.Status != lock.InProgress) {
		t.Fatalf("Acquire of other after the pause: %+v, %v", got, err)
	}
	l2, err := s.Acquire(ctx, lock.Request{Key: "third"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Extend(ctx, l2.Lease)[0]; err != nil {
		t.Fatalf("Extend after the pause: %v", err)
	}
}
