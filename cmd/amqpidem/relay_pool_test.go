package main_test

import (
	"context"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// relay on a pool of one connection (pool_max_conns=1 in --postgres)
// publishes: it listens on a connection outside the pool.
func TestRelayCommandPoolOfOne(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	ctx := context.Background()
	cfg, ob := outboxSchema(t, pool)
	queue := testenv.Name(t)
	ch := testenv.QueueChannel(t, queue)
	write := func(body string) {
		t.Helper()
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := ob.Write(ctx, tx, pgstore.Message{RoutingKey: queue, Publishing: amqp.Publishing{Body: []byte(body)}})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	receive := func(body string) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			d, ok, err := ch.Get(queue, true)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				if string(d.Body) != body {
					t.Fatalf("got %q, want %q", d.Body, body)
				}
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%q not published in 15 s", body)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	dsn := pgenv.DSN(t)
	if strings.Contains(dsn, "?") {
		dsn += "&pool_max_conns=1"
	} else {
		dsn += "?pool_max_conns=1"
	}
	write("before")
	var stderr testenv.SyncBuffer
	cmd := exec.Command(bin, "relay", "--postgres", dsn, "--pg-schema", cfg.Schema, "--amqp", testenv.AMQPURL(t))
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill() }()
	receive("before")
	write("after") // woken by the notification, or the poll (1 s)
	receive("after")
	_ = cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("relay after SIGTERM: %v\n%s", err, stderr.String())
	}
	if s := stderr.String(); strings.Contains(s, "level=WARN") || strings.Contains(s, "level=ERROR") {
		t.Errorf("the relay warned:\n%s", s)
	}
}
