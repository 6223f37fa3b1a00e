package pgstore_test

import (
	"strings"
	"testing"

	"github.com/amqpidem/amqpidem/pgstore"
)

// A name with a "$" could end the dollar-quoted bodies of the functions
// and DO blocks the migration creates ($fn$, $do$) and run what follows as
// SQL: Validate, MigrationSQL and New refuse it, naming the field.
func TestConfigRefusesDollarInNames(t *testing.T) {
	const hostile = `t$fn$; DROP TABLE x; $fn$`
	for field, c := range map[string]pgstore.Config{
		"Config.Table":       {Table: hostile},
		"Config.OutboxTable": {OutboxTable: "o$do$"},
		"Config.Schema":      {Schema: "s$fn$"},
	} {
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), field) || !strings.Contains(err.Error(), "$") {
			t.Errorf("Validate(%s with $): %v, want an error naming %s and $", field, err, field)
		}
		if sql, err := pgstore.MigrationSQL(c); err == nil {
			t.Errorf("MigrationSQL(%s with $): no error; it would run:\n%.400s", field, sql)
		}
	}
	if err := (pgstore.Config{Table: "Orders-Records é", Schema: `we"ird`, OutboxTable: "ob_1"}).Validate(); err != nil {
		t.Errorf("Validate of names without $: %v", err)
	}
}
