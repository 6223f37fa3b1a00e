package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	"github.com/aws/smithy-go"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/amqpidem/amqpidem/lock"
)

// notNowCodes are the error codes of a DynamoDB that cannot do the request
// now but may soon: lock.ErrUnavailable. A missing table is among them, as
// pgstore counts a missing table: the store is not ready, its error says
// to create it.
var notNowCodes = map[string]bool{
	"ProvisionedThroughputExceededException": true,
	"ThrottlingException":                    true,
	"RequestLimitExceeded":                   true,
	"LimitExceededException":                 true,
	"InternalServerError":                    true,
	"ServiceUnavailable":                     true,
	"TransactionConflictException":           true,
	"TransactionInProgressException":         true,
	"ReplicatedWriteConflictException":       true,
	"ResourceNotFoundException":              true,
	"RequestTimeout":                         true,
	"RequestTimeoutException":                true,
}

// maybeAppliedCodes are the codes among notNowCodes after which the
// request may still have taken effect.
var maybeAppliedCodes = map[string]bool{
	"InternalServerError":     true,
	"ServiceUnavailable":      true,
	"RequestTimeout":          true,
	"RequestTimeoutException": true,
}

// isUnavailable reports whether err says DynamoDB could not answer: a
// transport error, a timeout, a 5xx, or a code of notNowCodes.
func isUnavailable(err error) bool {
	var se *smithyhttp.RequestSendError
	var ne net.Error
	var ae smithy.APIError
	var re *smithyhttp.ResponseError
	switch {
	case err == nil:
		return false
	case errors.As(err, &se), errors.As(err, &ne), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed):
		return true // the request was not sent, or its answer did not come
	case errors.As(err, &ae) && notNowCodes[ae.ErrorCode()]:
		return true
	}
	return errors.As(err, &re) && re.HTTPStatusCode() >= 500
}

// classify wraps err with lock.ErrUnavailable when DynamoDB could not
// answer.
func classify(err error) error {
	if isUnavailable(err) && !errors.Is(err, lock.ErrUnavailable) {
		if missingTable(err) {
			return fmt.Errorf("%w: the table does not exist (create it with dynamostore.CreateTable): %w", lock.ErrUnavailable, err)
		}
		return fmt.Errorf("%w: %w", lock.ErrUnavailable, err)
	}
	return err
}

// answered reports whether err says a request did not take effect: DynamoDB
// answered it with an error that is not one of maybeAppliedCodes, or the
// connection could not be made. RetryAcquire does not resend such a try.
func answered(err error) bool {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return !maybeAppliedCodes[ae.ErrorCode()]
	}
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "dial"
}

// refusedWhole reports whether err is DynamoDB refusing a request as such
// (a ValidationException: an item over 400 KB, a transaction over 4 MB,
// two writes of one item, an invalid expression; AccessDeniedException; a
// missing table): an answer saying the request was not carried out, of a
// kind the SDK does not retry and that the same request gets every time,
// so that none of the SDK's earlier attempts of it was carried out either.
// Throttling, conflicts and server errors are not: the SDK retries them,
// and an attempt before the last, whose answer was lost or was an error
// that may have been applied, may have taken effect.
func refusedWhole(err error) bool {
	var ae smithy.APIError
	if !errors.As(err, &ae) {
		return false
	}
	code := ae.ErrorCode()
	switch {
	case code == "ResourceNotFoundException":
		return true
	case notNowCodes[code], maybeAppliedCodes[code], code == "IdempotentParameterMismatchException":
		return false
	}
	var re *smithyhttp.ResponseError
	return !errors.As(err, &re) || re.HTTPStatusCode() < 500
}

// missingTable reports whether err says the table does not exist.
func missingTable(err error) bool {
	var ae smithy.APIError
	return errors.As(err, &ae) && ae.ErrorCode() == "ResourceNotFoundException"
}

// conditionFailed returns the item a failed condition saw (nil when there
// was none), and whether err is a failed condition at all.
func conditionFailed(err error) (map[string]types.AttributeValue, bool) {
	var ccf *types.ConditionalCheckFailedException
	if errors.As(err, &ccf) {
		return ccf.Item, true
	}
	return nil, false
}
