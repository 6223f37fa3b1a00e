// This file is not part of the template: copy main.go alone.
//
// It turns `go run ./examples/longjob` into a self-checking run of main.go's
// handler, config and serve: a job ten times longer than its lease (5 s on
// a 500 ms lease TTL) while a duplicate of its message arrives. The
// duplicate finds the job in progress: it is requeued as busy, again and
// again, until the job completes; then it is acked as a duplicate without
// running. The program exits non-zero if the job ran other than once. It
// uses a queue and Redis prefix of its own and deletes them at the end.

package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
)

// init runs the self-check in place of main, and exits.
func init() {
	if !testing.Testing() {
		demo.Main("longjob", timeLimit, selfCheck)
	}
}

const (
	leaseTTL  = 500 * time.Millisecond
	jobTakes  = 10 * leaseTTL
	jobKey    = "nightly-report-2024-12-31"
	timeLimit = 60 * time.Second
)

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	// The store is shared by every consumer of the run: the lease on a key
	// is what keeps two of them from running it at once.
	env, store, err := demo.Start(ctx, "longjob", log)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := env.Close(); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	// main.go's handler, its runs counted.
	var runs atomic.Int32
	started := make(chan struct{})
	job := reportHandler(log, jobTakes)
	counted := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		if runs.Add(1) == 1 {
			close(started)
		}
		return job.Handle(ctx, d)
	})

	tally := demo.NewTally()
	cfg := consumerConfig(env.AMQPURL, env.Name, log) // main.go's, on a short lease
	cfg.LeaseTTL = leaseTTL
	cfg.Retention = time.Hour
	cfg.InProgressDelay = time.Second // the longest the duplicate waits between tries
	cfg.Observer = tally
	consumer, err := amqpidem.NewConsumer(store, cfg, counted)
	if err != nil {
		return err
	}
	stop, stopConsumer := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve(stop, consumer, 10*time.Second, log) }()
	defer func() {
		stopConsumer()
		if serr := <-served; serr != nil {
			err = errors.Join(err, fmt.Errorf("consumer: %w", serr))
		}
	}()

	pub := amqpidem.NewPublisher(env.Conn)
	defer pub.Close()
	msg := amqp.Publishing{MessageId: jobKey, ContentType: "text/plain", Body: []byte("write the year-end report")}
	if err := pub.Publish(ctx, "", env.Name, msg); err != nil {
		return err
	}
	select {
	case <-started:
	case <-ctx.Done():
		return fmt.Errorf("waiting for the job to start: %w", context.Cause(ctx))
	}
	log.Info("publishing a duplicate while the job runs", "key", jobKey)
	if err := pub.Publish(ctx, "", env.Name, msg); err != nil {
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
