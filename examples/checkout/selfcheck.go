// This file is not part of the template: copy main.go (and charge_test.go)
// alone.
//
// It turns `go run ./examples/checkout` into a self-checking run of
// main.go's group, handler and retry policy on two queues of its own:
// payments and refunds are published, some twice; a declined card and a
// panicking payment are dead-lettered at once, a payment the API keeps
// answering 429 is retried after the wait it asked for (shortened here)
// until its attempts run out. Every other payment and refund must complete
// once, its copies acked as duplicates; the group must report ready while
// it consumes, and shut both consumers down at the end.

package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
)

// init runs the self-check in place of main, and exits.
func init() {
	if !testing.Testing() {
		demo.Main("checkout", timeLimit, selfCheck)
	}
}

const timeLimit = 60 * time.Second

// story is what happens to one message id.
type story struct {
	id, queue, body string
	copies          int              // published this many times
	want            amqpidem.Outcome // its last outcome
	retries         int              // Retried outcomes before it
}

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	env, store, err := demo.Start(ctx, "checkout", log)
	if err != nil {
		return err
	}
	payments, refunds := env.Name, env.Name+".refunds"
	defer func() {
		if cerr := env.Close(refunds, refunds+".dlq"); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()
	rateLimitWait = 300 * time.Millisecond // the API's 429 asks for less here

	stories := []story{
		{"pay-1", payments, "12.50", 2, amqpidem.Completed, 0},
		{"pay-2", payments, "7.00", 1, amqpidem.Completed, 0},
		{"pay-3", payments, "99.90", 3, amqpidem.Completed, 0},
		{"pay-4", payments, "declined", 1, amqpidem.DeadLettered, 0},
		{"pay-5", payments, "panic", 1, amqpidem.DeadLettered, 0},
		{"pay-6", payments, "429", 1, amqpidem.DeadLettered, 3},
		{"ref-1", refunds, "12.50", 2, amqpidem.Completed, 0},
		{"ref-2", refunds, "3.10", 1, amqpidem.Completed, 0},
	}
	tally := demo.NewTally()
	g, err := newGroup(store, env.AMQPURL, payments, refunds, tally, log)
	if err != nil {
		return err
	}
	stop, stopGroup := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve(stop, g, 10*time.Second, log) }()
	defer func() {
		stopGroup()
		if serr := <-served; serr != nil {
			err = errors.Join(err, fmt.Errorf("group: %w", serr))
		}
	}()
	// The consumers declare their queues when they start: ready means both
	// consume.
	if err := waitReady(ctx, g); err != nil {
		return err
	}

	pub := amqpidem.NewPublisher(env.Conn)
	defer pub.Close()
	for _, s := range stories {
		for range s.copies {
			if err := pub.Publish(ctx, "", s.queue, amqp.Publishing{MessageId: s.id, Body: []byte(s.body)}); err != nil {
				return err
			}
		}
	}
	err = tally.Wait(ctx, func(c demo.Counts) bool {
		for _, s := range stories {
			if c.Key(s.id, s.want) < 1 || c.Key(s.id, amqpidem.Duplicate) < s.copies-1 {
				return false
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("waiting for every message's outcome: %w", err)
	}
	return report(tally, stories)
}

// waitReady waits until g's consumers all consume.
func waitReady(ctx context.Context, g *amqpidem.Group) error {
	for {
		err := g.Ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the group never got ready: %w", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func report(tally *demo.Tally, stories []story) error {
	var problems []string
	tally.View(func(c demo.Counts) {
		fmt.Printf("\nsummary\n")
		for _, s := range stories {
			got := c.Key(s.id, s.want)
			retried := c.Key(s.id, amqpidem.Retried)
			fmt.Printf("  %-7s %-8s %-9s %-14s x%d, retried %d, duplicates %d\n", s.id, queueOf(s, stories), s.body, s.want, got,
				retried, c.Key(s.id, amqpidem.Duplicate))
			if got != 1 {
				problems = append(problems, fmt.Sprintf("%s: %v %d times, want once", s.id, s.want, got))
			}
			if retried != s.retries {
				problems = append(problems, fmt.Sprintf("%s: retried %d times, want %d", s.id, retried, s.retries))
			}
			if n := c.Key(s.id, amqpidem.Completed); s.want != amqpidem.Completed && n != 0 {
				problems = append(problems, fmt.Sprintf("%s: completed %d times, want never", s.id, n))
			}
		}
	})
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	fmt.Printf("  %-7s every payment and refund ran as often as it should, on two queues in one group\n", "ok")
	return nil
}

// queueOf names s's queue for the summary: payments or refunds.
func queueOf(s story, stories []story) string {
	if s.queue == stories[0].queue {
		return "payments"
	}
	return "refunds"
}
