package testenv

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestSkipMissing(t *testing.T) {
	tests := []struct {
		short bool
		ci    string
		want  bool
	}{
		{short: false, ci: "", want: false},
		{short: false, ci: "true", want: false},
		{short: true, ci: "", want: true},
		{short: true, ci: "false", want: true},
		{short: true, ci: "true", want: false},
	}
	for _, tt := range tests {
		if got := skipMissing(tt.short, tt.ci); got != tt.want {
			t.Errorf("skipMissing(%v, %q): got %v, want %v", tt.short, tt.ci, got, tt.want)
		}
	}
}

func TestCommand(t *testing.T) {
	addr := RedisAddr(t)
	tests := []struct {
		args    []string
		want    string
		wantErr bool
	}{
		{args: []string{"PING"}, want: "PONG"},
		{args: []string{"ECHO", "a b\r\nc"}, want: "a b\r\nc"},
		{args: []string{"EXISTS", Name(t)}, want: "0"},
		{args: []string{"NOSUCHCOMMAND"}, wantErr: true},
	}
	for _, tt := range tests {
		got, err := command(addr, time.Second, tt.args...)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("command(%q): got %q, %v; want %q, error %v", tt.args, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestCommandReply(t *testing.T) {
	addr := RedisAddr(t)
	missing := Name(t)

	got, err := commandReply(addr, time.Second, "GET", missing)
	if err != nil || got != nil {
		t.Fatalf("GET %s: got %#v, %v; want nil, nil", missing, got, err)
	}
	if _, err := command(addr, time.Second, "GET", missing); err == nil {
		t.Fatalf("command(GET %s): got nil error for a null reply", missing)
	}

	got, err = commandReply(addr, time.Second, "CONFIG", "GET", "maxmemory-policy")
	if err != nil {
		t.Fatalf("CONFIG GET: %v", err)
	}
	if m := fields(got); m["maxmemory-policy"] == "" {
		t.Fatalf("CONFIG GET maxmemory-policy: got %#v, want a field and its value", got)
	}

	// COMMAND INFO replies with nested arrays and integers.
	got, err = commandReply(addr, time.Second, "COMMAND", "INFO", "get")
	if err != nil {
		t.Fatalf("COMMAND INFO get: %v", err)
	}
	outer, _ := got.([]any)
	if len(outer) != 1 {
		t.Fatalf("COMMAND INFO get: got %#v, want one entry", got)
	}
	entry, _ := outer[0].([]any)
	if len(entry) < 2 || entry[0] != "get" || entry[1] != "2" {
		t.Fatalf("COMMAND INFO get: got %#v, want [get 2 ...]", outer[0])
	}

	_, err = commandReply(addr, time.Second, "NOSUCHCOMMAND")
	var re replyError
	if !errors.As(err, &re) || !strings.HasPrefix(string(re), "ERR ") {
		t.Fatalf("NOSUCHCOMMAND: got %v, want a replyError starting with ERR", err)
	}
}
