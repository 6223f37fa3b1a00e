// Package kit connects package amqpidemtest to amqpidem's processing,
// which amqpidem does not export: amqpidem sets Wrap when it is loaded
// (an init function), so Wrap is set in every program that imports
// amqpidem, and only there. Nothing but amqpidemtest uses it.
//
// It guarantees nothing beyond what Wrap's documentation says: the
// processing is a Wrapper's, with the broker replaced by a Broker; and it
// adds no dependency to amqpidem's.
package kit
