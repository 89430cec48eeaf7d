module streaming-hub/examples/receivers/go

go 1.21.0

require github.com/standard-webhooks/standard-webhooks/libraries v0.0.1
