// Command longjob runs a job ten times longer than its lease (5 s on a
// 500 ms lease TTL) while a duplicate of its message arrives.
//
// The heartbeat renews the lease while the job runs, so the duplicate finds
// the key in progress: it is requeued as busy, again and again, until the
// job completes; then it is acked as a duplicate without running. The
// program exits non-zero if the job ran other than once.
//
// Run it with `go run ./examples/longjob` once Redis and RabbitMQ are up
// (`make services`). REDIS_ADDR and AMQP_URL override the defaults
// 127.0.0.1:6379 and amqp://guest:guest@127.0.0.1:5672/.
package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

const (
	leaseTTL  = 500 * time.Millisecond
	jobTakes  = 10 * leaseTTL
	jobKey    = "nightly-report-2024-12-31"
	timeLimit = 60 * time.Second
)

func main() { demo.Main("longjob", timeLimit, run) }

func run(ctx context.Context) (err error) {
	log := demo.Logger()
	env, err := demo.Connect(ctx, "longjob")
	if err != nil {
		return err
	}
	defer func() {
		if cerr := env.Close(); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	store, err := lock.NewRedisStore(env.Redis, lock.Config{Prefix: env.Name, Logger: log})
	if err != nil {
		return err
	}
	if err := store.Check(ctx); err != nil {
		return err
	}
	if err := env.DeclareQueue(env.Name); err != nil {
		return err
	}

	var runs atomic.Int32
	started := make(chan struct{})
	job := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		if runs.Add(1) == 1 {
			close(started)
		}
		info, _ := amqpidem.FromContext(ctx)
		log.Info("job started", "key", info.Key, "fence", info.Fence, "takes", jobTakes, "lease_ttl", leaseTTL)
		begin := time.Now()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		done := time.NewTimer(jobTakes)
		defer done.Stop()
		for {
			select {
			case <-tick.C:
				// The keeper renews the lease about every TTL/3; its
				// deadline stays ahead although the job outlived the TTL
				// long ago.
				lease, _ := heartbeat.LeaseFromContext(ctx)
				log.Info("job working", "key", info.Key, "elapsed", time.Since(begin).Round(100*time.Millisecond),
					"lease_expires_in", time.Until(lease.Deadline).Round(time.Millisecond))
			case <-done.C:
				log.Info("job done", "key", info.Key, "took", time.Since(begin))
				return []byte("report written"), nil
			case <-ctx.Done(): // the lease was lost, or shutdown: stop now
				return nil, context.Cause(ctx)
			}
		}
	})

	tally := demo.NewTally()
	consumer, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		Config: amqpidem.Config{
			Queue:           env.Name,
			LeaseTTL:        leaseTTL,
			Retention:       time.Hour,
			InProgressDelay: time.Second, // how long the duplicate waits between tries
			Logger:          log,
			Observer:        tally,
		},
		URL: env.AMQPURL,
	}, job)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	runErr := make(chan error, 1)
	wg.Go(func() {
		if err := consumer.Run(ctx); !errors.Is(err, amqpidem.ErrConsumerClosed) {
			runErr <- err
		}
	})
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if serr := consumer.Shutdown(sctx); serr != nil {
			err = errors.Join(err, fmt.Errorf("shutdown: %w", serr))
		}
		wg.Wait()
	}()

	pub, err := demo.NewPublisher(env.Conn)
	if err != nil {
		return err
	}
	defer pub.Close()
	msg := amqp.Publishing{MessageId: jobKey, ContentType: "text/plain", Body: []byte("write the year-end report")}
	if err := pub.Publish(ctx, env.Name, msg); err != nil {
		return err
	}
	select {
	case <-started:
	case err := <-runErr:
		return err
	case <-ctx.Done():
		return fmt.Errorf("waiting for the job to start: %w", context.Cause(ctx))
	}
	log.Info("publishing a duplicate while the job runs", "key", jobKey)
	if err := pub.Publish(ctx, env.Name, msg); err != nil {
		return err
	}

	err = tally.Wait(ctx, func(c demo.Counts) bool {
		return c.Key(jobKey, amqpidem.Completed) == 1 && c.Key(jobKey, amqpidem.Duplicate) == 1
	})
	if err != nil {
		return fmt.Errorf("waiting for the job and its duplicate: %w", err)
	}
	return report(tally, int(runs.Load()))
}

func report(tally *demo.Tally, runs int) error {
	var problems []string
	tally.View(func(c demo.Counts) {
		busy, abandoned := c.Key(jobKey, amqpidem.Busy), c.Key(jobKey, amqpidem.Abandoned)
		var took time.Duration
		for _, e := range c.Events() {
			if e.Outcome == amqpidem.Completed {
				took = e.Handler
			}
		}
		fmt.Printf("\nsummary (lease TTL %v, job %v)\n", leaseTTL, jobTakes)
		fmt.Printf("  %-14s %d (took %v, %.0fx the lease TTL)\n", "job ran", runs, took.Round(time.Millisecond), float64(took)/float64(leaseTTL))
		fmt.Printf("  %-14s %d (the duplicate, while the job held the lease)\n", "busy requeues", busy)
		fmt.Printf("  %-14s %d (acked without running)\n", "duplicate", c.Key(jobKey, amqpidem.Duplicate))
		fmt.Printf("  %-14s %d\n", "abandoned", abandoned)
		if busy == 0 {
			problems = append(problems, "the duplicate was never requeued as busy")
		}
		if abandoned != 0 {
			problems = append(problems, fmt.Sprintf("%d executions abandoned (lease lost?)", abandoned))
		}
	})
	if runs != 1 {
		problems = append(problems, fmt.Sprintf("the job ran %d times, want once", runs))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	fmt.Printf("  %-14s the job ran once; its duplicate waited, then was acked without running\n", "ok")
	return nil
}
