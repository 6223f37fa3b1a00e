package heartbeat_test

import (
	"context"
	"fmt"
	"time"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

func Example() {
	ctx := context.Background()
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		panic(err)
	}
	keeper, err := heartbeat.New(store, heartbeat.Config{})
	if err != nil {
		panic(err)
	}
	defer keeper.Shutdown(ctx)

	res, err := store.Acquire(ctx, lock.Request{Key: "order-42", TTL: 600 * time.Millisecond})
	if err != nil || res.Status != lock.Acquired {
		panic(fmt.Sprint(res.Status, err))
	}

	// The handler runs for two TTLs; the keeper extends the lease meanwhile.
	hctx, stop := keeper.Keep(ctx, res.Lease)
	lease, _ := heartbeat.LeaseFromContext(hctx)
	fmt.Println("attempt:", lease.Attempt)
	select {
	case <-hctx.Done():
		fmt.Println("lease lost:", context.Cause(hctx))
		return
	case <-time.After(1200 * time.Millisecond):
	}
	stop()

	if err := store.Complete(ctx, res.Lease, []byte("shipped")); err != nil {
		panic(err)
	}
	fmt.Println("completed")
	// Output:
	// attempt: 1
	// completed
}
