package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws/retry"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	"github.com/aws/smithy-go"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/amqpidem/amqpidem/lock"
)

func TestClassify(t *testing.T) {
	api := func(code string) error { return &smithy.GenericAPIError{Code: code, Message: "m"} }
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	cases := []struct {
		name        string
		err         error
		unavailable bool
		answered    bool
		refused     bool // refusedWhole: nothing written, by any of the SDK's attempts
	}{
		{"throttled", &types.ProvisionedThroughputExceededException{}, true, true, false},
		{"throttling", api("ThrottlingException"), true, true, false},
		{"request limit", &types.RequestLimitExceeded{}, true, true, false},
		{"internal error", &types.InternalServerError{}, true, false, false},
		{"unavailable", api("ServiceUnavailable"), true, false, false},
		{"transaction conflict", &types.TransactionConflictException{}, true, true, false},
		{"transaction in progress", &types.TransactionInProgressException{}, true, true, false},
		{"idempotent mismatch", &types.IdempotentParameterMismatchException{}, false, true, false},
		{"missing table", &types.ResourceNotFoundException{}, true, true, true},
		{"condition failed", &types.ConditionalCheckFailedException{}, false, true, true},
		{"validation", api("ValidationException"), false, true, true},
		{"access denied", api("AccessDeniedException"), false, true, true},
		{"dial", fmt.Errorf("send: %w", dial), true, true, false},
		{"read reset", &net.OpError{Op: "read", Err: errors.New("reset")}, true, false, false},
		{"deadline", context.DeadlineExceeded, true, false, false},
		{"cancelled", context.Canceled, false, false, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := classify(fmt.Errorf("op: %w", tc.err))
			if got, want := errors.Is(err, lock.ErrUnavailable), tc.unavailable; got != want {
				t.Fatalf("ErrUnavailable: got %v, want %v (%v)", got, want, err)
			}
			if !errors.Is(err, tc.err) {
				t.Fatalf("classify lost the original error: %v", err)
			}
			if got, want := answered(tc.err), tc.answered; got != want {
				t.Fatalf("answered: got %v, want %v", got, want)
			}
			if got, want := refusedWhole(fmt.Errorf("op: %w", tc.err)), tc.refused; got != want {
				t.Fatalf("refusedWhole: got %v, want %v", got, want)
			}
		})
	}
	if err := classify(&types.ResourceNotFoundException{}); !errors.Is(err, lock.ErrUnavailable) || !strings.Contains(err.Error(), "CreateTable") {
		t.Fatalf("missing table: %v, want ErrUnavailable saying to create it", err)
	}
}

func TestConfigValidate(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero", Config{}, true},
		{"largest result", Config{Config: lock.Config{MaxResultSize: MaxResultSizeLimit}}, true},
		{"result over an item", Config{Config: lock.Config{MaxResultSize: MaxResultSizeLimit + 1}}, false},
		{"replicas", Config{Config: lock.Config{Replicas: 1}}, false},
		{"short table", Config{Table: "ab"}, false},
		{"negative skew", Config{MaxClockSkew: -1}, false},
		{"negative concurrency", Config{ExtendConcurrency: -1}, false},
		{"short TTL delay", Config{TTLDelay: 59e9}, false},
		{"bad lock config", Config{Config: lock.Config{LeaseTTL: -1}}, false},
	}
	for _, tc := range cases {
		if err := tc.cfg.Validate(); (err == nil) != tc.ok {
			t.Errorf("%s: Validate() = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
	d := Config{}.withDefaults()
	if d.Table != DefaultTable || d.MaxClockSkew != DefaultMaxClockSkew || d.ExtendConcurrency != DefaultExtendConcurrency ||
		d.TTLDelay != DefaultTTLDelay || d.MaxResultSize != lock.DefaultMaxResultSize {
		t.Fatalf("defaults: %+v", d)
	}
}

func TestParseInt(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "42": 42, "-3": -3, "1764000000000000": 1764000000000000, "1.764e+15": 1764000000000000} {
		if got, err := parseInt(in); err != nil || got != want {
			t.Errorf("parseInt(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"1.5", "x", "1e30"} {
		if _, err := parseInt(in); err == nil {
			t.Errorf("parseInt(%q): no error", in)
		}
	}
}

// TestClassifySDKChain: the SDK's own wrapping of a refused connection
// (an operation error around its retries around a response error of
// status 0 around the send error) is unavailable.
func TestClassifySDKChain(t *testing.T) {
	send := &smithyhttp.RequestSendError{Err: &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}}
	err := &smithy.OperationError{ServiceID: "DynamoDB", OperationName: "UpdateItem",
		Err: &retry.MaxAttemptsError{Attempt: 4, Err: &smithyhttp.ResponseError{Response: &smithyhttp.Response{Response: &http.Response{StatusCode: 0}}, Err: send}}}
	if got := classify(err); !errors.Is(got, lock.ErrUnavailable) {
		t.Fatalf("classify(%v): not ErrUnavailable", err)
	}
	if !answered(err) {
		t.Fatal("a refused connection: answered false, want true (the request never arrived)")
	}
	server := &smithy.OperationError{Err: &smithyhttp.ResponseError{Response: &smithyhttp.Response{Response: &http.Response{StatusCode: 503}}, Err: errors.New("bad gateway")}}
	if got := classify(server); !errors.Is(got, lock.ErrUnavailable) {
		t.Fatalf("classify(503): %v, not ErrUnavailable", got)
	}
	client := &smithy.OperationError{Err: &smithyhttp.ResponseError{Response: &smithyhttp.Response{Response: &http.Response{StatusCode: 400}}, Err: errors.New("bad request")}}
	if got := classify(client); errors.Is(got, lock.ErrUnavailable) {
		t.Fatalf("classify(400): %v, want not ErrUnavailable", got)
	}
}
