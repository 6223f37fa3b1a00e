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

var dynamo = &Service{
	Name:      "DynamoDB",
	EnvVar:    "DYNAMODB_ENDPOINT",
	Local:     "http://127.0.0.1:8000",
	Probe:     probeDynamo,
	Failure:   " does not answer DynamoDB requests",
	Container: "dynamodb",
	Image:     dynamoImage,
	Help: `Start one of:
  make services                  (scripts/dynamo.sh builds and starts minidyn on 127.0.0.1:8000; needs the go command)
  bash scripts/dynamo.sh         (the same, DynamoDB alone)
  docker compose up -d --wait dynamodb   (Amazon's DynamoDB Local from docker-compose.yml, same port)
or set DYNAMODB_ENDPOINT=http://host:port to a running DynamoDB-compatible server,
or start a Docker engine (the tests then run ` + dynamoImage + ` through testcontainers-go).`,
}

// DynamoEndpoint returns the endpoint URL (http://host:port) of a
// DynamoDB-compatible server for integration tests: DYNAMODB_ENDPOINT if
// set, else http://127.0.0.1:8000 if it answers, else an
// amazon/dynamodb-local container if a Docker engine answers. The answer is
// cached for the test binary. When none can be found the test fails, or is
// skipped under -short without CI=true; the message says what to start.
//
// It speaks to the server over plain HTTP, without the AWS SDK, so that
// testenv's users do not depend on it. The server takes any credentials
// and region; tests keep their tables under a [Name].
func DynamoEndpoint(t testing.TB) string {
	t.Helper()
	return dynamo.Addr(t)
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
