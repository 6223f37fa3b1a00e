package main_test

import (
	"context"
	"encoding/json"
	"net"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// dlq replay --all on an empty dead-letter queue replays nothing: exit
// code 3, as for a --key with no dead letter.
func TestReplayEmptyDLQ(t *testing.T) {
	url := testenv.AMQPURL(t)
	queue := testenv.Name(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue+".dlq", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testenv.DeleteQueues(t, url, queue+".dlq") })
	_, errOut, code, _ := runBin(t, "dlq", "replay", queue, "--all", "--amqp", url,
		"--redis", "redis://"+testenv.RedisAddr(t)+"/0", "--prefix", "cli-"+queue)
	if code != 3 || !strings.Contains(errOut, "no dead letter in "+queue+".dlq") {
		t.Fatalf("replay --all of an empty DLQ: exit %d, want 3 saying so\n%s", code, errOut)
	}
}

// A Redis that refuses the connection is one line on stderr, naming the
// key and endpoint as given, not go-redis's log of each dial nor the
// store's internal key.
func TestRefusedRedisOneLine(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // refused from now on
	_, errOut, code, _ := runBin(t, "inspect", "order-1", "--queue", "orders", "--timeout", "3s", "--redis", "redis://"+addr+"/0")
	if code != 1 {
		t.Fatalf("exit %d, want 1\n%s", code, errOut)
	}
	if lines := strings.Split(strings.TrimSpace(errOut), "\n"); len(lines) != 1 {
		t.Errorf("stderr has %d lines, want the error alone:\n%s", len(lines), errOut)
	}
	if !strings.Contains(errOut, `key "order-1" of orders`) || strings.Contains(errOut, `\x00`) {
		t.Errorf("the error does not name the key and endpoint as given, or shows the store key:\n%s", errOut)
	}
}

// relay list with a --limit below 1 is bad usage (2), not a database
// error; relay redrive of IDs some of which are not dead says which.
func TestRelayUsageAndNotDead(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	ctx := context.Background()
	cfg, ob := outboxSchema(t, pool)
	flags := []string{"--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema}
	for _, limit := range []string{"-1", "0"} {
		_, errOut, code, _ := runBin(t, append([]string{"relay", "list", "--limit", limit}, flags...)...)
		if code != 2 || !strings.Contains(errOut, "--limit "+limit) {
			t.Errorf("relay list --limit %s: exit %d, want 2 naming the flag\n%s", limit, code, errOut)
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := ob.Write(ctx, tx, pgstore.Message{RoutingKey: "nowhere", Publishing: amqp.Publishing{Body: []byte("x")}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{cfg.Schema, "amqpidem_outbox"}.Sanitize()
	rows, _ := pool.Query(ctx, "SELECT id FROM "+table+" ORDER BY id")
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(ids) != 3 {
		t.Fatalf("row IDs: %v %v", ids, err)
	}
	itoa := func(id int64) string { return strconv.FormatInt(id, 10) }
	if _, err := pool.Exec(ctx, "UPDATE "+table+" SET state = 'd' WHERE id = ANY($1)", ids[:2]); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"relay", "redrive", itoa(ids[0]), itoa(ids[1]), itoa(ids[2]), "99999", "--json"}, flags...)
	out, errOut, code, _ := runBin(t, args...)
	var got struct {
		Redriven int64
		NotDead  []int64 `json:"not_dead"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || code != 0 {
		t.Fatalf("relay redrive: exit %d, %v\n%s%s", code, err, out, errOut)
	}
	if got.Redriven != 2 || len(got.NotDead) != 2 || got.NotDead[0] != ids[2] || got.NotDead[1] != 99999 {
		t.Fatalf("relay redrive --json: %+v, want 2 redriven, not dead %d and 99999", got, ids[2])
	}
	out, _, code, _ = runBin(t, append([]string{"relay", "redrive", itoa(ids[2]), "99999"}, flags...)...)
	if code != 3 || !strings.Contains(out, "not dead, left as they were: "+itoa(ids[2])+" and 99999") {
		t.Fatalf("relay redrive of rows not dead: exit %d, want 3 naming them\n%s", code, out)
	}
}

// A mistyped command gets cobra's suggestion on lines of its own, not
// one line with its newlines and tab shown as \n and \t.
func TestUnknownCommandSuggestionReadable(t *testing.T) {
	_, errOut, code, _ := runBin(t, "replay", "orders", "--all")
	if code != 2 {
		t.Fatalf("exit %d, want 2 (usage)\n%s", code, errOut)
	}
	if strings.Contains(errOut, `\n`) || strings.Contains(errOut, `\t`) {
		t.Errorf("the suggestion shows escaped newlines or tabs:\n%s", errOut)
	}
	if !strings.Contains(errOut, "\nDid you mean this?\n") || !strings.Contains(errOut, "relay") {
		t.Errorf("no suggestion on a line of its own:\n%s", errOut)
	}
}
