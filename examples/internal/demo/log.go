package demo

import (
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/lmittmann/tint"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// outcomeColors are the ANSI colours of the "outcome" attribute amqpidem
// logs for every message.
var outcomeColors = map[string]uint8{
	amqpidem.Completed.String():    10, // bright green
	amqpidem.Duplicate.String():    14, // bright cyan
	amqpidem.Busy.String():         11, // bright yellow
	amqpidem.Retried.String():      13, // bright magenta
	amqpidem.DeadLettered.String(): 9,  // bright red
	amqpidem.Dropped.String():      8,  // grey
	amqpidem.Abandoned.String():    1,  // red
}

// Logger returns a logger writing coloured lines to stderr, at debug level
// so that amqpidem's duplicate and busy records show. The "outcome"
// attribute is coloured by outcome; the "queue" attribute is left out, as
// each example has one queue, printed once. Colour is off when NO_COLOR is set or
// stderr is not a terminal (FORCE_COLOR turns it back on).
func Logger() *slog.Logger {
	return NewLogger(os.Stderr)
}

// NewLogger is Logger writing to w.
func NewLogger(w io.Writer) *slog.Logger {
	return slog.New(tint.NewTextHandler(w, &tint.Options{
		Level:      slog.LevelDebug,
		TimeFormat: "15:04:05.000",
		NoColor:    !useColor(w),
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			err, isErr := a.Value.Any().(error)
			a = amqpidem.EscapeControl(groups, a)
			if a.Key == "queue" && len(groups) == 0 {
				return slog.Attr{} // one queue per example, logged once at start
			}
			if a.Key == "outcome" && len(groups) == 0 {
				if c, ok := outcomeColors[a.Value.String()]; ok {
					return tint.Attr(c, a)
				}
			}
			if a.Value.Kind() == slog.KindDuration {
				return slog.Duration(a.Key, round(a.Value.Duration()))
			}
			if isErr && err != nil {
				return tint.Attr(9, a)
			}
			return a
		},
	}))
}

func useColor(w io.Writer) bool {
	if os.Getenv("FORCE_COLOR") != "" {
		return true
	}
	if os.Getenv("NO_COLOR") != "" {
		return false
	}
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// round keeps three significant digits or so: 1.234ms, 45.6ms, 4.001s.
func round(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(time.Millisecond)
	case d >= 10*time.Millisecond:
		return d.Round(100 * time.Microsecond)
	default:
		return d.Round(time.Microsecond)
	}
}
