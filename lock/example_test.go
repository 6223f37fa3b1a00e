package lock_test

import (
	"context"
	"fmt"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

func Example() {
	store, err := lock.NewMemoryStore(lock.Config{LeaseTTL: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()

	res, _ := store.Acquire(ctx, lock.Request{Key: "payment-42"})
	fmt.Println(res.Status, "attempt", res.Lease.Attempt)

	// A duplicate delivery while the first still runs.
	dup, _ := store.Acquire(ctx, lock.Request{Key: "payment-42"})
	fmt.Println(dup.Status)

	_ = store.Complete(ctx, res.Lease, []byte("receipt-1"))

	// A duplicate after completion gets the stored result.
	done, _ := store.Acquire(ctx, lock.Request{Key: "payment-42"})
	fmt.Println(done.Status, string(done.Value))
	// Output:
	// acquired attempt 1
	// in_progress
	// completed receipt-1
}
