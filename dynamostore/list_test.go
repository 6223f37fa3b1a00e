package dynamostore_test

import (
	"context"
	"errors"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb"

	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/lock"
)

// noScan is a Client without Scan.
type noScan struct{ dynamostore.Client }

// List refuses a cursor it did not give, and says a client without Scan
// cannot list.
func TestListBadCursorAndNoScan(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		if _, err := s.List(context.Background(), lock.ListRequest{Cursor: "not hex"}); !errors.Is(err, lock.ErrBadCursor) {
			t.Fatalf("List with a bad cursor: got %v, want ErrBadCursor", err)
		}
		var c dynamostore.Client = srv.client
		if _, ok := c.(*dynamodb.Client); !ok {
			t.Fatalf("client %T", c)
		}
		bare, err := dynamostore.New(noScan{srv.client}, dynamostore.Config{Table: "tab"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := bare.List(context.Background(), lock.ListRequest{}); !errors.Is(err, lock.ErrListUnsupported) {
			t.Fatalf("List with a client without Scan: got %v, want ErrListUnsupported", err)
		}
	})
}
