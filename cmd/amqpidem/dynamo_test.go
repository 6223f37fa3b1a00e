package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// dynamoTables makes a records table of the test's own on srv, and an
// effects table (partition key "id", S) when effects is set, both deleted
// when the test ends. It returns a client, the endpoint and the store's
// config. The client signs as the command does when the environment names
// no credentials (testenv.DynamoAccessKeyID, region us-east-1): DynamoDB
// Local keeps a database per access key and region, so a table made with
// other credentials would not exist for the command.
func dynamoTables(t *testing.T, srv testenv.DynamoServer, effects string) (*dynamodb.Client, string, dynamostore.Config) {
	t.Helper()
	ep := srv.Endpoint
	client := dynamodb.New(dynamodb.Options{
		Region:       testenv.DynamoRegion,
		BaseEndpoint: aws.String(ep),
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: testenv.DynamoAccessKeyID, SecretAccessKey: testenv.DynamoSecretAccessKey, Source: "tests"}, nil
		}),
	})
	cfg := dynamostore.Config{Table: testenv.Name(t)}
	cfg.Prefix = "cli-dynamo"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables := []string{cfg.Table}
	if effects != "" {
		tables = append(tables, effects)
	}
	t.Cleanup(func() {
		for _, name := range tables {
			_, _ = client.DeleteTable(context.Background(), &dynamodb.DeleteTableInput{TableName: aws.String(name)})
		}
	})
	if err := dynamostore.CreateTable(ctx, client, cfg); err != nil {
		t.Fatal(err)
	}
	if effects != "" {
		_, err := client.CreateTable(ctx, &dynamodb.CreateTableInput{
			TableName:            aws.String(effects),
			AttributeDefinitions: []types.AttributeDefinition{{AttributeName: aws.String("id"), AttributeType: types.ScalarAttributeTypeS}},
			KeySchema:            []types.KeySchemaElement{{AttributeName: aws.String("id"), KeyType: types.KeyTypeHash}},
			BillingMode:          types.BillingModePayPerRequest,
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return client, ep, cfg
}

// dynamoCLI runs the binary with args, the DynamoDB flags and no AWS
// credentials in its environment (the flags' placeholder ones serve a
// local server), and fails the test unless it exits with code.
func dynamoCLI(t *testing.T, code int, flags []string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, append(args, flags...)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "AWS_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "AMQPIDEM_SIGNING_KEY="+rigSigningKey)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	got := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		got = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	if got != code {
		t.Fatalf("amqpidem %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), got, code, stdout.String(), stderr.String())
	}
	if code != 0 {
		return stderr.String()
	}
	return stdout.String()
}

// The same commands read and forget the records of the DynamoDB store, on
// each of the tests' DynamoDB servers.
func TestInspectForgetDynamo(t *testing.T) {
	testenv.EachDynamo(t, func(t *testing.T, srv testenv.DynamoServer) {
		client, ep, cfg := dynamoTables(t, srv, "")
		s, err := dynamostore.New(client, cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey("ledger", "pay-9"), TTL: time.Minute})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire: %v %v", res.Status, err)
		}
		if err := s.Fail(ctx, res.Lease, "permanent failure: account closed"); err != nil {
			t.Fatal(err)
		}
		flags := []string{"--dynamodb-table", cfg.Table, "--dynamodb-endpoint", ep, "--prefix", cfg.Prefix}

		var rec struct {
			State, Error, Location string
			Fence                  int64
		}
		out := dynamoCLI(t, 0, flags, "inspect", "pay-9", "--queue", "ledger", "--json")
		if err := json.Unmarshal([]byte(out), &rec); err != nil || rec.State != "failed" || rec.Fence != res.Lease.Fence ||
			rec.Error != "permanent failure: account closed" || !strings.Contains(rec.Location, cfg.Table) {
			t.Fatalf("inspect: %v %+v\n%s", err, rec, out)
		}
		dynamoCLI(t, 0, flags, "forget", "pay-9", "--queue", "ledger")
		if out := dynamoCLI(t, 3, flags, "inspect", "pay-9", "--queue", "ledger"); !strings.Contains(out, "DynamoDB table "+cfg.Table) {
			t.Fatalf("inspect after forget names no DynamoDB table:\n%s", out)
		}
		// The environment variables name the store as the flags do.
		cmd := exec.Command(bin, "inspect", "pay-9", "--queue", "ledger", "--prefix", cfg.Prefix)
		cmd.Env = append(os.Environ(), "AMQPIDEM_DYNAMODB_TABLE="+cfg.Table, "AMQPIDEM_DYNAMODB_ENDPOINT="+ep,
			"AWS_ACCESS_KEY_ID=", "AWS_PROFILE=")
		out2, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 3 || !strings.Contains(string(out2), cfg.Table) {
			t.Fatalf("inspect with AMQPIDEM_DYNAMODB_*: %v\n%s", err, out2)
		}
		// Two stores at once are refused.
		dynamoCLI(t, 2, append(flags, "--postgres", "postgres://127.0.0.1:1/none"), "inspect", "pay-9", "--queue", "ledger")
	})
}

// dlq replay --forget forgets the DynamoDB store's record of a failure, so
// that the replayed copy runs (through a TxHandler: its effect once) rather
// than being a failed duplicate.
func TestReplayForgetDynamo(t *testing.T) {
	testenv.EachDynamo(t, func(t *testing.T, srv testenv.DynamoServer) {
		effects := testenv.Name(t) + "-effects"
		client, ep, cfg := dynamoTables(t, srv, effects)
		s, err := dynamostore.New(client, cfg)
		if err != nil {
			t.Fatal(err)
		}
		url := testenv.AMQPURL(t)
		queue := testenv.Name(t)
		conn, err := amqp.Dial(url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		testenv.DeleteQueues(t, url, queue, queue+".dlq")

		events := make(chan amqpidem.Event, 100)
		var broken atomic.Bool
		broken.Store(true)
		h := s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			if broken.Load() {
				return nil, amqpidem.Permanent(errors.New("card declined"))
			}
			tx.Update(&types.Update{
				TableName:                 aws.String(effects),
				Key:                       map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: d.MessageId}},
				UpdateExpression:          aws.String("ADD #n :one"),
				ExpressionAttributeNames:  map[string]string{"#n": "n"},
				ExpressionAttributeValues: map[string]types.AttributeValue{":one": &types.AttributeValueMemberN{Value: "1"}},
			})
			return []byte("paid"), nil
		})
		c, err := amqpidem.NewConsumer(s, amqpidem.ConsumerConfig{URL: url, Config: amqpidem.Config{SigningKey: []byte(rigSigningKey),
			Queue: queue, Logger: slog.New(slog.DiscardHandler),
			Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { events <- e }),
		}}, h)
		if err != nil {
			t.Fatal(err)
		}
		testrun.Consumer(t, c)
		wait := func(o amqpidem.Outcome) {
			t.Helper()
			select {
			case e := <-events:
				if e.Outcome != o {
					t.Fatalf("outcome %v (%s), want %v", e.Outcome, e.Err, o)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("no %v outcome in 30s", o)
			}
		}
		if err := ch.PublishWithContext(context.Background(), "", queue, false, false,
			amqp.Publishing{MessageId: "pay-1", DeliveryMode: amqp.Persistent, Body: []byte("pay")}); err != nil {
			t.Fatal(err)
		}
		wait(amqpidem.DeadLettered)
		broken.Store(false)

		flags := []string{"--dynamodb-table", cfg.Table, "--dynamodb-endpoint", ep, "--prefix", cfg.Prefix, "--amqp", url}
		dynamoCLI(t, 0, flags, "dlq", "replay", queue, "--key", "pay-1", "--forget")
		wait(amqpidem.Completed)
		out, err := client.GetItem(context.Background(), &dynamodb.GetItemInput{TableName: aws.String(effects),
			Key: map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: "pay-1"}}, ConsistentRead: aws.Bool(true)})
		if err != nil {
			t.Fatal(err)
		}
		n, _ := out.Item["n"].(*types.AttributeValueMemberN)
		if n == nil || n.Value != strconv.Itoa(1) {
			t.Fatalf("effect of pay-1 after the replay: %v, want 1", out.Item["n"])
		}
		rec := dynamoCLI(t, 0, flags, "inspect", "pay-1", "--queue", queue, "--json")
		if !strings.Contains(rec, `"state": "completed"`) && !strings.Contains(rec, `"state":"completed"`) {
			t.Fatalf("inspect after the replay:\n%s", rec)
		}
	})
}
