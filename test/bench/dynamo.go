package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/lock"
)

// The DynamoDB variants (issue 25), on the classic queue only, against
// the DynamoDB-compatible server at -dynamo-endpoint (DYNAMODB_ENDPOINT,
// default minidyn's http://127.0.0.1:8000 from scripts/dynamo.sh). Their
// handler's effect is one Put of an item per message into an effects
// table of the run's own:
//
//	dynamo-unique     amqpidem.Consumer on a dynamostore.Store with its
//	                  TxHandler: the effect and the completed record in one
//	                  TransactWriteItems; every key new
//	dynamo-duplicate  the same, every message a duplicate of dynamo-unique's
//	                  completed work (it replays the round's keys)
//
// Their ratios over bare are printed after every other line. No target:
// an emulator's speed says little of DynamoDB's, whose every request is a
// network round trip to the service. Their N is fixed (-dynamo-n, or -n),
// not calibrated, and each round has a records table of its own: minidyn
// copies every table a transaction writes (its rollback snapshot), so its
// transactions slow down as the tables grow, and a rate measured on a
// table of thousands of records says even less than one on a fresh table.
const (
	dynamoUnique    variant = "dynamo-unique"
	dynamoDuplicate variant = "dynamo-duplicate"
)

// dynamoVariants have the last ratio lines, in order.
var dynamoVariants = []variant{dynamoUnique, dynamoDuplicate}

// isDynamo says whether v is one of the DynamoDB variants.
func (v variant) isDynamo() bool { return v == dynamoUnique || v == dynamoDuplicate }

// defaultDynamoEndpoint is the server the bench uses unless
// DYNAMODB_ENDPOINT or -dynamo-endpoint names another: the one
// scripts/dynamo.sh starts (minidyn; DynamoDB Local listens there too).
const defaultDynamoEndpoint = "http://127.0.0.1:8000"

// addDynamoFlags adds the DynamoDB variants' flags to fs.
func addDynamoFlags(fs *flag.FlagSet, o *options) {
	fs.BoolVar(&o.Dynamo, "dynamo", o.Dynamo, "run the DynamoDB variants (dynamo-unique, dynamo-duplicate) on the classic queue")
	fs.IntVar(&o.DynamoN, "dynamo-n", o.DynamoN, "messages of each dynamo run (-n, when set, wins); not calibrated")
	fs.StringVar(&o.DynamoEndpoint, "dynamo-endpoint", envOr("DYNAMODB_ENDPOINT", defaultDynamoEndpoint),
		"URL of the DynamoDB-compatible server of the dynamo variants (env DYNAMODB_ENDPOINT); any credentials")
}

// dynEnv is the DynamoDB side of a run: a client, and the records tables
// it made ("<round prefix>-records", one per round), deleted by close.
type dynEnv struct {
	client  *dynamodb.Client
	records []string
}

// dynUnreachable is openDynamo's error when the server does not answer:
// the bench then goes on without the dynamo variants.
type dynUnreachable struct {
	endpoint string
	err      error
}

func (e *dynUnreachable) Error() string {
	return fmt.Sprintf("DynamoDB at %s does not answer: %v", e.endpoint, e.err)
}

func (e *dynUnreachable) Unwrap() error { return e.err }

// openDynamo makes the client and checks that the server answers.
func openDynamo(ctx context.Context, o options, base string) (*dynEnv, error) {
	conns := o.Concurrency + 8
	client := dynamodb.New(dynamodb.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(o.DynamoEndpoint),
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "bench", SecretAccessKey: "bench", Source: "bench"}, nil
		}),
		// Keep a connection per handler: the SDK's default keeps few
		// idle, and the others would be dialled again on every request.
		HTTPClient: &http.Client{Transport: &http.Transport{MaxIdleConns: conns, MaxIdleConnsPerHost: conns,
			IdleConnTimeout: time.Minute, DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}},
		// minidyn sends no CRC32 of its answers, which the SDK warns of.
		DisableValidateResponseChecksum: true,
	})
	d := &dynEnv{client: client}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := d.createRecords(cctx, base+"-probe"); err != nil {
		var oe *net.OpError
		if errors.As(err, &oe) || errors.Is(err, context.DeadlineExceeded) {
			return nil, &dynUnreachable{endpoint: o.DynamoEndpoint, err: err}
		}
		return nil, err
	}
	return d, nil
}

// createRecords makes the records table named table, unless it did
// already, and remembers it for close.
func (d *dynEnv) createRecords(ctx context.Context, table string) error {
	if slices.Contains(d.records, table) {
		return nil
	}
	if err := dynamostore.CreateTable(ctx, d.client, dynamostore.Config{Table: table}); err != nil {
		return err
	}
	d.records = append(d.records, table)
	return nil
}

// close deletes the records tables.
func (d *dynEnv) close(ctx context.Context) error {
	var errs []error
	for _, t := range d.records {
		errs = append(errs, d.deleteTable(ctx, t))
	}
	return errors.Join(errs...)
}

func (d *dynEnv) deleteTable(ctx context.Context, table string) error {
	_, err := d.client.DeleteTable(ctx, &dynamodb.DeleteTableInput{TableName: aws.String(table)})
	var missing *types.ResourceNotFoundException
	if err != nil && !errors.As(err, &missing) {
		return fmt.Errorf("deleting DynamoDB table %s: %w", table, err)
	}
	return nil
}

// dynRun is one dynamo run's store and effects table ("<queue>-effects",
// made before measuring, counted and deleted after).
type dynRun struct {
	d       *dynEnv
	store   *dynamostore.Store
	effects string
}

// open makes a run's store, on the records table of its round (prefix:
// the round's; dynamo-duplicate replays what dynamo-unique completed
// there), and its effects table.
func (d *dynEnv) open(ctx context.Context, queue, prefix string) (*dynRun, error) {
	table := prefix + "-records"
	if err := d.createRecords(ctx, table); err != nil {
		return nil, err
	}
	s, err := dynamostore.New(d.client, dynamostore.Config{Config: lock.Config{Prefix: prefix}, Table: table})
	if err != nil {
		return nil, err
	}
	r := &dynRun{d: d, store: s, effects: queue + "-effects"}
	_, err = d.client.CreateTable(ctx, &dynamodb.CreateTableInput{
		TableName:            aws.String(r.effects),
		AttributeDefinitions: []types.AttributeDefinition{{AttributeName: aws.String("id"), AttributeType: types.ScalarAttributeTypeS}},
		KeySchema:            []types.KeySchemaElement{{AttributeName: aws.String("id"), KeyType: types.KeyTypeHash}},
		BillingMode:          types.BillingModePayPerRequest,
	})
	if err != nil {
		return nil, fmt.Errorf("creating DynamoDB table %s: %w", r.effects, err)
	}
	return r, nil
}

// close counts the effect items and deletes their table.
func (r *dynRun) close(ctx context.Context) (int, error) {
	n := 0
	pages := dynamodb.NewScanPaginator(r.d.client, &dynamodb.ScanInput{TableName: aws.String(r.effects),
		Select: types.SelectCount, ConsistentRead: aws.Bool(true)})
	var err error
	for pages.HasMorePages() {
		page, perr := pages.NextPage(ctx)
		if perr != nil {
			err = fmt.Errorf("counting the items of %s: %w", r.effects, perr)
			break
		}
		n += int(page.Count)
	}
	return n, errors.Join(err, r.d.deleteTable(ctx, r.effects))
}

// txFunc is the dynamo variants' work: one Put per message, sent with the
// record's completion.
func (r *dynRun) txFunc(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
	tx.Put(&types.Put{
		TableName: aws.String(r.effects),
		Item:      map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: d.MessageId}},
	})
	return nil, nil
}

// startDynamo starts variant v's consumer on queue with r's store.
func (e *env) startDynamo(ctx context.Context, v variant, r *dynRun, queue string, t *tally) (consumer, error) {
	want := amqpidem.Completed
	if v == dynamoDuplicate {
		want = amqpidem.Duplicate
	}
	return startIdem(ctx, r.store, idemConfig{
		url: e.opts.AMQPURL, queue: queue, queueType: "classic",
		prefetch: e.opts.Prefetch, concurrency: e.opts.Concurrency,
		leaseTTL: leaseTTL, retention: retention,
		handler: r.store.TxHandler(r.txFunc), want: want,
	}, t)
}

// openDynamoEnv connects to DynamoDB for the dynamo variants, unless they
// are off or have no classic queue to run on. When the server does not
// answer, the bench says so and goes on without them.
func (e *env) openDynamoEnv(ctx context.Context, rep *report) error {
	switch {
	case !e.opts.Dynamo:
		rep.DynamoSkipped = "-dynamo=false"
		return nil
	case !e.opts.measures(dynamoUnique):
		rep.DynamoSkipped = "-variants names none of them"
		return nil
	case !slices.Contains(e.opts.QueueTypes, "classic"):
		rep.DynamoSkipped = "they run on a classic queue, and -queues has none"
		return nil
	}
	d, err := openDynamo(ctx, e.opts, e.base)
	if err != nil {
		var unreachable *dynUnreachable
		if !errors.As(err, &unreachable) {
			return err
		}
		rep.DynamoSkipped = err.Error() + " (start one with: bash scripts/dynamo.sh, or set DYNAMODB_ENDPOINT; -dynamo=false skips them)"
		return nil
	}
	e.dyn = d
	return nil
}

// printDynamoRatios prints the dynamo variants' median rates over bare's on
// classic: the last lines of the output (none when they did not run).
func printDynamoRatios(out io.Writer, rep *report) {
	if rep.DynamoSkipped != "" {
		return
	}
	b := median(rates(rep.Runs, "classic", bare))
	for _, v := range dynamoVariants {
		if !slices.Contains(rep.Variants["classic"], v) {
			continue
		}
		r := 0.0
		if b > 0 {
			r = median(rates(rep.Runs, "classic", v)) / b
		}
		fmt.Fprintf(out, "ratio %s/bare classic %.2f\n", v, r)
	}
}
