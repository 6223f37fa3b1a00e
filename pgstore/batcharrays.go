package pgstore

import (
	"crypto/rand"
	"database/sql/driver"
	"encoding/hex"

	"github.com/jackc/pgx/v5/pgtype"
)

// The array parameters of the batch statements (AcquireBatch,
// finishBatch). pgx encodes a [][]byte, []string or []int64 argument by
// boxing each element in an interface (an allocation a key for each array:
// about ten a message of a batch); these types hand pgx a pointer to each
// element instead, which boxes without one, and which pgx encodes through
// the element's valuer method (pgtype.BytesValuer, TextValuer,
// Int64Valuer). The values sent are the same: an element's nil []byte is
// NULL, an empty one empty bytes, as for a [][]byte.

// byteaArray is a bytea[] parameter.
type byteaArray [][]byte

// byteaElem is an element of a byteaArray.
type byteaElem []byte

// BytesValue returns the element's bytes; nil is NULL.
func (e *byteaElem) BytesValue() ([]byte, error) { return *e, nil }

// Value returns the array as [][]byte, for pgx to encode by its Go type
// where it has no statement description (pgx encodes it, database/sql
// would not take it).
func (a byteaArray) Value() (driver.Value, error) { return [][]byte(a), nil }

// Dimensions returns the array's one dimension.
func (a byteaArray) Dimensions() []pgtype.ArrayDimension { return dimensions(len(a)) }

// Index returns element i.
func (a byteaArray) Index(i int) any { return (*byteaElem)(&a[i]) }

// IndexType returns the type of the elements Index returns.
func (a byteaArray) IndexType() any { return (*byteaElem)(nil) }

// textArray is a text[] parameter.
type textArray []string

// textElem is an element of a textArray.
type textElem string

// TextValue returns the element's text.
func (e *textElem) TextValue() (pgtype.Text, error) {
	return pgtype.Text{String: string(*e), Valid: true}, nil
}

// Value returns the array as []string, for pgx to encode by its Go type
// where it has no statement description (pgx encodes it, database/sql
// would not take it).
func (a textArray) Value() (driver.Value, error) { return []string(a), nil }

// Dimensions returns the array's one dimension.
func (a textArray) Dimensions() []pgtype.ArrayDimension { return dimensions(len(a)) }

// Index returns element i.
func (a textArray) Index(i int) any { return (*textElem)(&a[i]) }

// IndexType returns the type of the elements Index returns.
func (a textArray) IndexType() any { return (*textElem)(nil) }

// int8Array is a bigint[] parameter.
type int8Array []int64

// int8Elem is an element of an int8Array.
type int8Elem int64

// Int64Value returns the element's value.
func (e *int8Elem) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: int64(*e), Valid: true}, nil
}

// Value returns the array as []int64, for pgx to encode by its Go type
// where it has no statement description (pgx encodes it, database/sql
// would not take it).
func (a int8Array) Value() (driver.Value, error) { return []int64(a), nil }

// Dimensions returns the array's one dimension.
func (a int8Array) Dimensions() []pgtype.ArrayDimension { return dimensions(len(a)) }

// Index returns element i.
func (a int8Array) Index(i int) any { return (*int8Elem)(&a[i]) }

// IndexType returns the type of the elements Index returns.
func (a int8Array) IndexType() any { return (*int8Elem)(nil) }

// dimensions is the dimension of a one-dimensional array of n elements
// (an empty array for 0, never NULL).
func dimensions(n int) []pgtype.ArrayDimension {
	return []pgtype.ArrayDimension{{Length: int32(n), LowerBound: 1}}
}

// keyBytes returns key(j) as bytes for each j below n, all slices of one
// buffer (one allocation, not one a key).
func keyBytes(n int, key func(j int) string) [][]byte {
	size := 0
	for j := range n {
		size += len(key(j))
	}
	buf := make([]byte, 0, size)
	keys := make([][]byte, n)
	for j := range n {
		start := len(buf)
		buf = append(buf, key(j)...)
		keys[j] = buf[start:len(buf):len(buf)]
	}
	return keys
}

// newOwners returns n owner tokens as lock.NewOwner makes them (32 hex
// digits of 128 random bits), all slices of one string.
func newOwners(n int) []string {
	random := make([]byte, 16*n)
	_, _ = rand.Read(random) // crypto/rand.Read never fails (Go 1.24+).
	all := hex.EncodeToString(random)
	owners := make([]string, n)
	for j := range owners {
		owners[j] = all[32*j : 32*j+32]
	}
	return owners
}
