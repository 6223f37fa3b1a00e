package dynamostore_test

import (
	"context"
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// TestBatchTxHandlerNoLeaseFailedNotSent: a batch run without records
// (HandleBatch: a message processed without a lease, ProcessMissingKey or
// FailOpen, runs as a batch of one). BatchTxFunc's documentation: "A
// message answered with an error may have added writes to tx before it
// failed: they are never sent." HandleBatch sends tx whatever the
// BatchResults say: the writes of a message answered with a Permanent
// error are committed, and it is dead-lettered with its effect done.
func TestBatchTxHandlerNoLeaseFailedNotSent(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, prefix := srv.effects(t), testenv.Name(t)
		h := s.BatchTxHandler(func(ctx context.Context, tx *dynamostore.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			rs := make([]amqpidem.BatchResult, len(ds))
			for i, d := range ds {
				bump(tx, table, prefix+"-"+string(d.Body))
				rs[i].Err = amqpidem.Permanent(errors.New("declined after writing"))
			}
			return rs, nil
		})
		rs, err := h.HandleBatch(context.Background(), []*amqp.Delivery{{Body: []byte("nokey")}})
		if err != nil || len(rs) != 1 || !amqpidem.IsPermanent(rs[0].Err) {
			t.Fatalf("HandleBatch: %+v, %v; want the message's Permanent error", rs, err)
		}
		if n := srv.count(t, prefix+"-nokey"); n != 0 {
			t.Errorf("counter %d after a message answered with an error, want 0 (its writes are never sent)", n)
		}
	})
}
