package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
)

// TableClient is what CreateTable needs of a DynamoDB client;
// *dynamodb.Client has it.
type TableClient interface {
	CreateTable(ctx context.Context, in *dynamodb.CreateTableInput, opts ...func(*dynamodb.Options)) (*dynamodb.CreateTableOutput, error)
	DescribeTable(ctx context.Context, in *dynamodb.DescribeTableInput, opts ...func(*dynamodb.Options)) (*dynamodb.DescribeTableOutput, error)
	UpdateTimeToLive(ctx context.Context, in *dynamodb.UpdateTimeToLiveInput, opts ...func(*dynamodb.Options)) (*dynamodb.UpdateTimeToLiveOutput, error)
}

// TableInput returns the CreateTableInput of a records table named table:
// partition key "pk" of type B, no sort key, on-demand capacity
// (PAY_PER_REQUEST). Change the billing mode or add tags before passing
// it to CreateTable yourself, or to a CloudFormation or Terraform
// definition; the key schema must stay as it is. Enable TTL on the
// attribute "ttl" as well (CreateTable does).
func TableInput(table string) *dynamodb.CreateTableInput {
	return &dynamodb.CreateTableInput{
		TableName:            aws.String(table),
		AttributeDefinitions: []types.AttributeDefinition{{AttributeName: aws.String(attrPK), AttributeType: types.ScalarAttributeTypeB}},
		KeySchema:            []types.KeySchemaElement{{AttributeName: aws.String(attrPK), KeyType: types.KeyTypeHash}},
		BillingMode:          types.BillingModePayPerRequest,
	}
}

// tableWait bounds CreateTable's wait for a new table to become active.
const tableWait = 5 * time.Minute

// CreateTable creates the records table of cfg (Config.Table, default
// DefaultTable) as TableInput defines it, waits until it is active, and
// enables TTL on its attribute "ttl". A table that exists already is left
// as it is when its key schema is the right one (TTL is enabled on it
// still), and an error otherwise. Run it once, at deployment, with
// permissions a consumer does not need (dynamodb:CreateTable,
// DescribeTable, UpdateTimeToLive).
func CreateTable(ctx context.Context, client TableClient, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	table := cfg.withDefaults().Table
	_, err := client.CreateTable(ctx, TableInput(table))
	var inUse *types.ResourceInUseException
	if err != nil && !errors.As(err, &inUse) {
		return fmt.Errorf("dynamostore: create table %s: %w", table, err)
	}
	desc, err := waitActive(ctx, client, table)
	if err != nil {
		return err
	}
	if err := checkSchema(desc); err != nil {
		return err
	}
	_, err = client.UpdateTimeToLive(ctx, &dynamodb.UpdateTimeToLiveInput{
		TableName:               aws.String(table),
		TimeToLiveSpecification: &types.TimeToLiveSpecification{AttributeName: aws.String(attrTTL), Enabled: aws.Bool(true)},
	})
	if err != nil && !ttlAlreadyOn(err) {
		return fmt.Errorf("dynamostore: enabling TTL on the attribute %q of %s (a table has one TTL attribute: "+
			"if this one's is another, give the records a table of their own): %w", attrTTL, table, err)
	}
	return nil
}

// waitActive polls DescribeTable until table is active, at most tableWait
// within ctx. A table without a status counts as active: some emulators
// report none, and make tables at once.
func waitActive(ctx context.Context, client TableClient, table string) (*types.TableDescription, error) {
	ctx, cancel := context.WithTimeout(ctx, tableWait)
	defer cancel()
	wait := 50 * time.Millisecond
	for {
		out, err := client.DescribeTable(ctx, &dynamodb.DescribeTableInput{TableName: aws.String(table)})
		if err != nil {
			return nil, fmt.Errorf("dynamostore: waiting for table %s: %w", table, err)
		}
		if st := out.Table.TableStatus; st == types.TableStatusActive || st == "" {
			return out.Table, nil
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("dynamostore: waiting for table %s to become active: %w", table, ctx.Err())
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// ttlAlreadyOn reports whether UpdateTimeToLive failed because TTL is
// enabled already: DynamoDB answers a ValidationException then.
func ttlAlreadyOn(err error) bool {
	var ae interface{ ErrorMessage() string }
	return errors.As(err, &ae) && strings.Contains(strings.ToLower(ae.ErrorMessage()), "already enabled")
}

// checkSchema fails unless t's key schema is a partition key "pk" of type
// B alone.
func checkSchema(t *types.TableDescription) error {
	if t == nil {
		return errors.New("dynamostore: DescribeTable answered no table")
	}
	name := aws.ToString(t.TableName)
	if len(t.KeySchema) != 1 || aws.ToString(t.KeySchema[0].AttributeName) != attrPK || t.KeySchema[0].KeyType != types.KeyTypeHash {
		return fmt.Errorf("dynamostore: table %s does not have the key schema of a records table (partition key %q of type B, no sort key); see dynamostore.TableInput", name, attrPK)
	}
	for _, a := range t.AttributeDefinitions {
		if aws.ToString(a.AttributeName) == attrPK && a.AttributeType != types.ScalarAttributeTypeB {
			return fmt.Errorf("dynamostore: table %s: attribute %q is of type %s, want B; see dynamostore.TableInput", name, attrPK, a.AttributeType)
		}
	}
	return nil
}
