package dynamostore_test

import (
	"context"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// testSkew is the clock skew the tests allow: their leases expire in tens
// of milliseconds, and every store of a test shares one clock.
const testSkew = 5 * time.Millisecond

// server is one of the tests' DynamoDB servers (testenv.EachDynamo:
// minidyn and DynamoDB Local), with a client of it and the tables the
// tests share on it, each made once for the test binary.
type server struct {
	testenv.DynamoServer
	client *dynamodb.Client

	records, effectTable tableOnce
}

// tableOnce is a table made once for the test binary, or why it was not.
type tableOnce struct {
	once sync.Once
	name string
	err  error
}

var servers struct {
	mu     sync.Mutex
	byName map[string]*server
}

// TestMain deletes the tables the tests shared on each server once they
// are done: the servers outlive the test binary, and a DynamoDB Local
// holding the tables of many runs deletes expired items slowly.
func TestMain(m *testing.M) {
	code := m.Run()
	dropSharedTables()
	os.Exit(code)
}

// dropSharedTables deletes the records and effects tables made on each
// server, ignoring errors (a server gone meanwhile).
func dropSharedTables() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	servers.mu.Lock()
	defer servers.mu.Unlock()
	for _, srv := range servers.byName {
		for _, tb := range []*tableOnce{&srv.records, &srv.effectTable} {
			if tb.name != "" && tb.err == nil {
				_, _ = srv.client.DeleteTable(ctx, &dynamodb.DeleteTableInput{TableName: aws.String(tb.name)})
			}
		}
	}
}

// eachServer runs f on every DynamoDB server of the tests, as the subtests
// minidyn and dynamodb-local of t, in parallel with each other: the
// servers are separate processes, and the tests mostly wait on them.
func eachServer(t *testing.T, f func(t *testing.T, srv *server)) {
	t.Helper()
	onServers(t, true, f)
}

// eachServerInTurn is eachServer one server after the other, for suites
// with sub-second timing windows that the other server's load, on a busy
// machine, can stretch past (the conformance suite's expiry checks).
func eachServerInTurn(t *testing.T, f func(t *testing.T, srv *server)) {
	t.Helper()
	onServers(t, false, f)
}

func onServers(t *testing.T, parallel bool, f func(t *testing.T, srv *server)) {
	t.Helper()
	testenv.EachDynamo(t, func(t *testing.T, d testenv.DynamoServer) {
		if parallel {
			t.Parallel()
		}
		servers.mu.Lock()
		srv := servers.byName[d.Name]
		if srv == nil {
			srv = &server{DynamoServer: d}
			srv.client = srv.newClient()
			if servers.byName == nil {
				servers.byName = map[string]*server{}
			}
			servers.byName[d.Name] = srv
		}
		servers.mu.Unlock()
		f(t, srv)
	})
}

// newClient returns a client of the server. It signs as every client of
// the tests does (testenv.DynamoAccessKeyID): DynamoDB Local keeps a
// database per access key and region.
func (srv *server) newClient() *dynamodb.Client {
	return dynamodb.New(dynamodb.Options{
		Region:       testenv.DynamoRegion,
		BaseEndpoint: aws.String(srv.Endpoint),
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: testenv.DynamoAccessKeyID, SecretAccessKey: testenv.DynamoSecretAccessKey, Source: "tests"}, nil
		}),
	})
}

// sharedTable returns a client and a records table made once per server
// for the test binary, which tests share under prefixes of their own
// (lock.Config.Prefix).
func (srv *server) sharedTable(t testing.TB) (*dynamodb.Client, string) {
	t.Helper()
	srv.records.once.Do(func() {
		srv.records.name = testenv.Name(t)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		srv.records.err = dynamostore.CreateTable(ctx, srv.client, dynamostore.Config{Table: srv.records.name})
	})
	if srv.records.err != nil {
		t.Fatalf("CreateTable on %s: %v", srv.Name, srv.records.err)
	}
	return srv.client, srv.records.name
}

// newStore returns a store on the shared table with cfg, under a prefix of
// its own unless cfg names one, allowing testSkew unless cfg says.
func (srv *server) newStore(t testing.TB, cfg dynamostore.Config) *dynamostore.Store {
	t.Helper()
	client, table := srv.sharedTable(t)
	cfg.Table = table
	if cfg.Prefix == "" {
		cfg.Prefix = testenv.Name(t)
	}
	if cfg.MaxClockSkew == 0 {
		cfg.MaxClockSkew = testSkew
	}
	s, err := dynamostore.New(client, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return s
}

// effects returns the name of a table of effect items (partition key "id",
// a string), made once per server for the test binary.
func (srv *server) effects(t testing.TB) string {
	t.Helper()
	srv.effectTable.once.Do(func() {
		srv.effectTable.name = testenv.Name(t) + "-effects"
		_, srv.effectTable.err = srv.client.CreateTable(context.Background(), &dynamodb.CreateTableInput{
			TableName:            aws.String(srv.effectTable.name),
			AttributeDefinitions: []types.AttributeDefinition{{AttributeName: aws.String("id"), AttributeType: types.ScalarAttributeTypeS}},
			KeySchema:            []types.KeySchemaElement{{AttributeName: aws.String("id"), KeyType: types.KeyTypeHash}},
			BillingMode:          types.BillingModePayPerRequest,
		})
	})
	if srv.effectTable.err != nil {
		t.Fatalf("creating the effects table on %s: %v", srv.Name, srv.effectTable.err)
	}
	return srv.effectTable.name
}

// count is the effect counter of id: how many times an effect was applied
// (0 when it never was).
func (srv *server) count(t testing.TB, id string) int {
	t.Helper()
	out, err := srv.client.GetItem(context.Background(), &dynamodb.GetItemInput{
		TableName: aws.String(srv.effects(t)), Key: map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: id}},
		ConsistentRead: aws.Bool(true),
	})
	if err != nil {
		t.Fatal(err)
	}
	n, ok := out.Item["n"].(*types.AttributeValueMemberN)
	if !ok {
		return 0
	}
	v, err := strconv.Atoi(n.Value)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
