package console

import (
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// LeaseHealth is health(rec, ttl).String(), for the tests.
func LeaseHealth(rec lock.Record, ttl time.Duration) string { return health(rec, ttl).String() }

// Rates are the charts of a sampler of queues (none: any) and keep
// samples, fed the given counters at the given times, as "queue kind
// now peak points" lines.
func Rates(queues []string, keep int, at []time.Time, counts []map[string]map[string]float64) []string {
	s := newSampler(nil, queues, time.Second, time.Duration(keep-1)*time.Second, time.Second)
	for i := range at {
		s.add(at[i], counts[i])
	}
	var out []string
	for _, q := range s.rates().Queues {
		for _, c := range q.Charts {
			out = append(out, q.Queue+" "+c.Kind+" "+c.Now+" "+c.Peak+" "+c.Points)
		}
	}
	return out
}
