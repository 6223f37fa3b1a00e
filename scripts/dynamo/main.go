// Command dynamo-server is the DynamoDB-compatible server the tests of
// github.com/amqpidem/amqpidem run against when no other is configured:
// the HTTP server of github.com/truora/minidyn (open source, in memory),
// pinned in this directory's go.mod, listening on one address.
// scripts/dynamo.sh builds and starts it; it is a module of its own so that
// minidyn stays out of the main module's go.mod and go.sum.
//
// Usage:
//
//	dynamo-server [-addr 127.0.0.1:8000]
//
// minidyn serves the item and transaction operations (GetItem, PutItem,
// UpdateItem, DeleteItem, TransactWriteItems, CreateTable, DescribeTable,
// ...). It has no time to live: this program answers UpdateTimeToLive and
// DescribeTimeToLive itself, remembering the setting per table and never
// deleting anything, which is what a table whose TTL deletes lazily looks
// like to a test. Data lives in memory and dies with the process.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"io"
	"log"
	"net/http"
	"strings"
	"sync"
	"time"

	miniserver "github.com/truora/minidyn/server"
)

// ttlSpec is a table's time-to-live setting, as UpdateTimeToLive sets it.
type ttlSpec struct {
	AttributeName string `json:"AttributeName"`
	Enabled       bool   `json:"Enabled"`
}

// server adds the time-to-live operations to minidyn's handler.
type server struct {
	dynamo http.Handler
	mu     sync.Mutex
	ttl    map[string]ttlSpec // by table name
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	target := r.Header.Get("X-Amz-Target")
	op := target[strings.LastIndex(target, ".")+1:]
	if op != "UpdateTimeToLive" && op != "DescribeTimeToLive" {
		s.dynamo.ServeHTTP(w, r)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var in struct {
		TableName               string  `json:"TableName"`
		TimeToLiveSpecification ttlSpec `json:"TimeToLiveSpecification"`
	}
	if err := json.NewDecoder(bytes.NewReader(body)).Decode(&in); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out any
	if op == "UpdateTimeToLive" {
		s.ttl[in.TableName] = in.TimeToLiveSpecification
		out = map[string]any{"TimeToLiveSpecification": in.TimeToLiveSpecification}
	} else {
		spec, ok := s.ttl[in.TableName]
		desc := map[string]any{"TimeToLiveStatus": "DISABLED"}
		if ok && spec.Enabled {
			desc = map[string]any{"TimeToLiveStatus": "ENABLED", "AttributeName": spec.AttributeName}
		}
		out = map[string]any{"TimeToLiveDescription": desc}
	}
	w.Header().Set("Content-Type", "application/x-amz-json-1.0")
	_ = json.NewEncoder(w).Encode(out)
}

func main() {
	addr := flag.String("addr", "127.0.0.1:8000", "address to listen on")
	flag.Parse()
	srv := &http.Server{
		Addr:              *addr,
		Handler:           &server{dynamo: miniserver.NewServer(), ttl: map[string]ttlSpec{}},
		ReadHeaderTimeout: 10 * time.Second,
	}
	log.Printf("dynamo-server: minidyn listening on %s", *addr)
	log.Fatal(srv.ListenAndServe())
}
