package console

import (
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// LeaseHealth is health(rec, ttl).String(), for the tests.
func LeaseHealth(rec lock.Record, ttl time.Duration) string { return health(rec, ttl).String() }
