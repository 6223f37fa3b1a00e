package promamqpidem

import "time"

// SetClock makes m read the time from now.
func SetClock(m *Metrics, now func() time.Time) { m.now = now }
