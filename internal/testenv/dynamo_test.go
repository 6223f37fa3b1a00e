package testenv

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestDynamoEndpoint(t *testing.T) {
	for name, get := range map[string]func(testing.TB) string{"DynamoEndpoint": DynamoEndpoint, "DynamoLocalEndpoint": DynamoLocalEndpoint} {
		ep := get(t)
		if !strings.HasPrefix(ep, "http://") && !strings.HasPrefix(ep, "https://") {
			t.Fatalf("%s: got %q, want an http(s) URL", name, ep)
		}
		if err := probeDynamo(ep); err != nil {
			t.Fatalf("%s: probe of %s: %v", name, ep, err)
		}
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
	for _, svc := range []*Service{dynamo, dynamoLocal} {
		t.Run(svc.EnvVar, func(t *testing.T) {
			t.Setenv(svc.EnvVar, "http://127.0.0.1:1")
			tg := target{name: svc.Name, envVar: svc.EnvVar, local: svc.Local, probe: svc.Probe,
				failure: svc.Failure, service: svc.Container, image: svc.Image, help: svc.Help}
			addr, missing := resolve(tg, func() error { t.Fatalf("Docker looked for although %s is set", svc.EnvVar); return nil })
			if addr != "" || !strings.Contains(missing, svc.EnvVar+"=http://127.0.0.1:1") {
				t.Fatalf("unreachable %s: got %q, %q; want no address and a message naming it", svc.EnvVar, addr, missing)
			}
		})
	}
}

// TestEachDynamo: one subtest per server, named after it, each finding its
// server from its own environment variable.
func TestEachDynamo(t *testing.T) {
	answer := func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"__type":"com.amazonaws.dynamodb.v20120810#ResourceNotFoundException"}`))
	}
	a, b := httptest.NewServer(http.HandlerFunc(answer)), httptest.NewServer(http.HandlerFunc(answer))
	defer a.Close()
	defer b.Close()
	t.Setenv("TESTENV_DYNAMO_A", a.URL)
	t.Setenv("TESTENV_DYNAMO_B", b.URL)
	saved := dynamoServers
	t.Cleanup(func() { dynamoServers = saved })
	dynamoServers = dynamoServers[:0:0]
	for _, s := range []struct {
		name, env string
		strict    bool
	}{{"a", "TESTENV_DYNAMO_A", false}, {"b", "TESTENV_DYNAMO_B", true}} {
		dynamoServers = append(dynamoServers, dynamoSlot{s.name, s.strict, &Service{Name: s.name, EnvVar: s.env, Probe: probeDynamo}})
	}
	var got []string
	ok := EachDynamo(t, func(t *testing.T, srv DynamoServer) {
		got = append(got, t.Name()+" "+srv.Name+" "+srv.Endpoint+" "+map[bool]string{true: "strict", false: "lenient"}[srv.Strict])
	})
	want := []string{
		"TestEachDynamo/a a " + a.URL + " lenient",
		"TestEachDynamo/b b " + b.URL + " strict",
	}
	if !ok || strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("EachDynamo ran (ok %v):\n%s\nwant:\n%s", ok, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
