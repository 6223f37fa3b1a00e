package amqpidem

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"strconv"
)

func defaultConsumerName() string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	return host + "/" + strconv.Itoa(os.Getpid())
}

func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
