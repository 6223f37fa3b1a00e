package dynamostore_test

import (
	"context"
	"errors"
	"log"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
)

// A consumer whose handler records a payment in DynamoDB, in the same
// transaction as the message's record: the payment is written once per
// message, however often the message is delivered. (Normally the client
// comes from dynamodb.NewFromConfig with the SDK's config package.)
func ExampleStore_TxHandler() {
	ctx := context.Background()
	client := dynamodb.New(dynamodb.Options{Region: "eu-west-1"})
	if err := dynamostore.CreateTable(ctx, client, dynamostore.Config{}); err != nil { // once, at deployment
		log.Fatal(err)
	}
	store, err := dynamostore.New(client, dynamostore.Config{})
	if err != nil {
		log.Fatal(err)
	}
	h := store.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
		tx.Put(&types.Put{
			TableName: aws.String("payments"),
			Item: map[string]types.AttributeValue{
				"id":     &types.AttributeValueMemberS{Value: d.MessageId},
				"amount": &types.AttributeValueMemberN{Value: "100"},
			},
		})
		tx.Update(&types.Update{
			TableName:                 aws.String("accounts"),
			Key:                       map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: "acct-1"}},
			UpdateExpression:          aws.String("SET balance = balance - :amount"),
			ConditionExpression:       aws.String("balance >= :amount"),
			ExpressionAttributeValues: map[string]types.AttributeValue{":amount": &types.AttributeValueMemberN{Value: "100"}},
		})
		// Too little money fails the message for good rather than retry it.
		tx.OnConditionFailed = func(int, map[string]types.AttributeValue) error {
			return amqpidem.Permanent(errInsufficientFunds)
		}
		return []byte("paid"), nil
	})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL:    "amqp://guest:guest@127.0.0.1:5672/",
		Config: amqpidem.Config{Queue: "payments"},
	}, h)
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(c.Run(ctx))
}

var errInsufficientFunds = errors.New("insufficient funds")
