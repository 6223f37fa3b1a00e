// Package sdktest holds the tests of otelamqpidem that use the
// OpenTelemetry SDK. They live apart from the package so that a module
// importing otelamqpidem does not get the SDK in its go.sum through them:
// the application picks its SDK. It has no code of its own.
package sdktest
