// Package browser holds the console's tests in a real browser: chromedp
// driving Chromium (Debian's chromium package, at /usr/bin/chromium or
// $CHROMIUM) against "amqpidem console", built from this checkout, on the
// local Redis and RabbitMQ. It is a module of its own so that chromedp
// stays out of the main module's go.mod and go.sum, and so out of the
// go.sum of every module that imports amqpidem or console.
//
// Run them from this directory: go test ./...
package browser
