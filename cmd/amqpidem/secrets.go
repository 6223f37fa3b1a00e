package main

import (
	"os"

	"github.com/spf13/cobra"
)

// How the CLI keeps credentials out of what it prints: --help shows where
// a default came from rather than the URL or DSN the environment gave
// (hideEnvDefault); errors and messages name URLs and DSNs through
// internal/secret, never with a parser's error text, which quotes them.

// hideEnvDefault makes --help show "(from envName)" as the default of c's
// persistent flag name when the environment variable envName set it: its
// value is a URL or DSN that may carry a password.
func hideEnvDefault(c *cobra.Command, name, envName string) {
	if os.Getenv(envName) != "" {
		c.PersistentFlags().Lookup(name).DefValue = "(from " + envName + ")"
	}
}
