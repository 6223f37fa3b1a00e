package testenv

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestDynamoEndpoint(t *testing.T) {
	ep := DynamoEndpoint(t)
	if !strings.HasPrefix(ep, "http://") && !strings.HasPrefix(ep, "https://") {
		t.Fatalf("DynamoEndpoint: got %q, want an http(s) URL", ep)
	}
	if err := probeDynamo(ep); err != nil {
		t.Fatalf("probe of %s: %v", ep, err)
	}
}

func TestProbeDynamoRefusesOtherServers(t *testing.T) {
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("hello"))
	}))
	defer other.Close()
	if err := probeDynamo(other.URL); err == nil {
		t.Fatal("probe of a plain HTTP server: got nil, want an error")
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	if err := probeDynamo("http://" + addr); err == nil {
		t.Fatal("probe of a closed port: got nil, want an error")
	}
}

func TestResolveDynamoFromEnv(t *testing.T) {
	t.Setenv("DYNAMODB_ENDPOINT", "http://127.0.0.1:1")
	tg := target{name: dynamo.Name, envVar: dynamo.EnvVar, local: dynamo.Local, probe: dynamo.Probe,
		failure: dynamo.Failure, service: dynamo.Container, image: dynamo.Image, help: dynamo.Help}
	addr, missing := resolve(tg, func() error { t.Fatal("Docker looked for although DYNAMODB_ENDPOINT is set"); return nil })
	if addr != "" || !strings.Contains(missing, "DYNAMODB_ENDPOINT=http://127.0.0.1:1") {
		t.Fatalf("unreachable DYNAMODB_ENDPOINT: got %q, %q; want no address and a message naming it", addr, missing)
	}
}
