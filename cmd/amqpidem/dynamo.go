package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/spf13/cobra"

	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/secret"
	"github.com/amqpidem/amqpidem/lock"
)

// dynamoOptions are the flags of the DynamoDB store (dynamostore).
type dynamoOptions struct {
	table    string // the records table; set: the DynamoDB store
	endpoint string // a local DynamoDB-compatible server's URL
}

// localRegion is the region a client of a local server (--dynamodb-endpoint)
// signs with when the configuration names none: such servers take any.
const localRegion = "us-east-1"

// addDynamoFlags adds the DynamoDB store's flags to root.
func addDynamoFlags(root *cobra.Command, d *dynamoOptions) {
	f := root.PersistentFlags()
	f.StringVar(&d.table, "dynamodb-table", env("AMQPIDEM_DYNAMODB_TABLE", ""),
		"the records `table` of a dynamostore store (instead of Redis); credentials and region from the AWS SDK's default chain (AWS_REGION, AWS_PROFILE, ...)")
	f.StringVar(&d.endpoint, "dynamodb-endpoint", env("AMQPIDEM_DYNAMODB_ENDPOINT", ""),
		"`URL` of a local DynamoDB-compatible server (DynamoDB Local), for --dynamodb-table; region "+localRegion+" and the access key \"local\" unless the environment names credentials (DynamoDB Local without -sharedDb keeps one database per access key and region: sign as the application does)")
}

// openDynamo opens the DynamoDB store the flags name: the AWS SDK's
// default configuration (environment, shared config and credentials
// files, SSO, instance or task roles), with --dynamodb-endpoint as its
// endpoint when set. A local server checks no signature: when the
// environment names no credentials (no AWS_ACCESS_KEY_ID, AWS_PROFILE),
// the client signs with placeholder ones (access key "local") rather than
// search the chain for real ones. DynamoDB Local without -sharedDb keeps
// one database per access key and region, so the tables are found only
// when the application signed with the same key.
func (o *options) openDynamo(ctx context.Context) (lock.Admin, func(), error) {
	if o.pgDSN != "" {
		return nil, nil, withCode(exitUsage, "--postgres and --dynamodb-table name two stores; give one")
	}
	d := o.dynamo
	var opts []func(*config.LoadOptions) error
	if d.endpoint != "" {
		// The SDK's error for an endpoint that does not parse quotes it,
		// password included: refuse it first, redacted.
		if _, err := url.Parse(d.endpoint); err != nil {
			return nil, nil, withCode(exitUsage, "%w", secret.ParseError("--dynamodb-endpoint", d.endpoint, err))
		}
		opts = append(opts, config.WithBaseEndpoint(d.endpoint))
		if os.Getenv("AWS_ACCESS_KEY_ID") == "" && os.Getenv("AWS_PROFILE") == "" {
			opts = append(opts, config.WithCredentialsProvider(aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
				return aws.Credentials{AccessKeyID: "local", SecretAccessKey: "local", Source: "amqpidem --dynamodb-endpoint"}, nil
			})))
		}
	}
	cfg, err := config.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, nil, withCode(exitUsage, "the AWS configuration for --dynamodb-table: %w", err)
	}
	if cfg.Region == "" {
		if d.endpoint == "" {
			return nil, nil, withCode(exitUsage, "--dynamodb-table: no AWS region: set AWS_REGION (or a profile's region)")
		}
		cfg.Region = localRegion
	}
	scfg := dynamostore.Config{Table: d.table}
	scfg.Prefix, scfg.Logger = o.prefix, slog.New(slog.DiscardHandler)
	client := dynamodb.NewFromConfig(cfg, func(o *dynamodb.Options) {
		// Emulators do not all send the CRC32 of their answers (minidyn
		// sends none), which the SDK warns about on stderr.
		o.DisableValidateResponseChecksum = d.endpoint != ""
	})
	s, err := dynamostore.New(client, scfg)
	if err != nil {
		return nil, nil, withCode(exitUsage, "%w", err)
	}
	return s, func() {}, nil
}

// dynamoName names the DynamoDB store, for messages.
func (o *options) dynamoName() string {
	if o.dynamo.endpoint != "" {
		return fmt.Sprintf("DynamoDB table %s at %s", o.dynamo.table, secret.URL(o.dynamo.endpoint))
	}
	return fmt.Sprintf("DynamoDB table %s", o.dynamo.table)
}
