// Package operator holds the pieces of the operator's tools that the
// command (cmd/amqpidem) and the web console (console) must share so that
// they show the same thing the same way: how a dead letter's headers are
// read and whether a consumer's signature proves them amqpidem's
// (Describe, Origin), how a lease is told (LeaseText), how text from a
// message or a store is made safe to show (Escape), and how a store's
// error is stripped of the store key it quotes (KeyFree).
//
// It is internal: its API may change with the tools.
package operator
