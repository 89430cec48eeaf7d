// A minimal Streaming Hub webhook receiver (net/http + the Standard Webhooks Go library).
//
//	WEBHOOK_SECRET=whsec_... PORT=8000 go run .
//	go run . -self-test        # checks the library against shared/VECTORS.md
//
// What it does with each POST:
//  1. verifies `webhook-signature` over the raw body with the Standard Webhooks library (any of
//     the space-separated signatures may match: two are sent during a secret rotation; Verify
//     also rejects a `webhook-timestamp` more than 5 minutes off) -> 401 if it fails;
//  2. answers the verification handshake (`X-Lerian-Event-Type: streaming_hub.verification`)
//     by echoing the challenge;
//  3. deduplicates on `X-Lerian-Event-Id` (stable across retries), acknowledges with 2xx at
//     once and processes the event in a goroutine.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"sync"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
)

const (
	verificationType = "streaming_hub.verification"
	maxBody          = 10 << 20
)

// seenSet holds the event ids already accepted. In memory for the example only: production should
// use a durable store shared by all instances (a database unique key, Redis SET NX with a TTL,
// ...), since retries can span ~28 hours and may reach another instance.
type seenSet struct {
	mu  sync.Mutex
	ids map[string]struct{}
}

// firstSeen records id and reports whether it was new.
func (s *seenSet) firstSeen(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.ids[id]; ok {
		return false
	}
	s.ids[id] = struct{}{}
	return true
}

func process(eventID string, h http.Header, body []byte) {
	// Real processing goes here (after the 2xx was sent). Make it idempotent too.
	log.Printf("processing %s type=%s attempt=%s bytes=%d",
		eventID, h.Get("X-Lerian-Event-Type"), h.Get("X-Lerian-Attempt"), len(body))
}

func handler(wh *standardwebhooks.Webhook, seen *seenSet) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST only", http.StatusMethodNotAllowed)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody)) // raw bytes
		if err != nil {
			http.Error(w, "bad body", http.StatusRequestEntityTooLarge)
			return
		}
		if err := wh.Verify(body, r.Header); err != nil {
			http.Error(w, "invalid signature", http.StatusUnauthorized)
			return
		}

		if r.Header.Get("X-Lerian-Event-Type") == verificationType {
			var probe struct {
				Challenge string `json:"challenge"`
			}
			if err := json.Unmarshal(body, &probe); err != nil {
				http.Error(w, "bad verification body", http.StatusBadRequest)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]string{"challenge": probe.Challenge})
			return
		}

		eventID := r.Header.Get("X-Lerian-Event-Id")
		if eventID == "" {
			eventID = r.Header.Get("webhook-id")
		}
		if seen.firstSeen(eventID) {
			go process(eventID, r.Header.Clone(), body)
		}
		w.WriteHeader(http.StatusNoContent) // duplicates are acknowledged too, or the hub retries
	}
}

// ---- self-test: shared/VECTORS.md, "Standard Webhooks signature (delivery side)" ------------
const (
	vSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	vID     = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	vTS     = 1614265330
	vBody   = `{"test": 2432232314}`
	vSig    = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
)

func selfTest() int {
	failures := 0
	check := func(name string, ok bool) {
		if ok {
			fmt.Println("ok   " + name)
		} else {
			fmt.Println("FAIL " + name)
			failures++
		}
	}
	headers := func(sig string) http.Header {
		h := http.Header{}
		h.Set("webhook-id", vID)
		h.Set("webhook-timestamp", fmt.Sprint(vTS))
		h.Set("webhook-signature", sig)
		return h
	}
	mustWebhook := func(secret string) *standardwebhooks.Webhook {
		wh, err := standardwebhooks.NewWebhook(secret)
		if err != nil {
			fmt.Println("FAIL NewWebhook:", err)
			os.Exit(1)
		}
		return wh
	}

	wh := mustWebhook(vSecret)
	sig, err := wh.Sign(vID, time.Unix(vTS, 0), []byte(vBody))
	check("Sign() reproduces the vector signature", err == nil && sig == vSig)

	// The vector is from 2021: Verify enforces the 5-minute tolerance, so it must reject it today;
	// VerifyIgnoringTimestamp checks the signature alone.
	err = wh.Verify([]byte(vBody), headers(vSig))
	check("Verify() rejects the vector at today's clock (timestamp tolerance)",
		errors.Is(err, standardwebhooks.ErrMessageTooOld))
	check("VerifyIgnoringTimestamp() accepts the vector",
		wh.VerifyIgnoringTimestamp([]byte(vBody), headers(vSig)) == nil)
	check("VerifyIgnoringTimestamp() rejects a tampered body",
		errors.Is(wh.VerifyIgnoringTimestamp([]byte(`{"test": 2432232315}`), headers(vSig)),
			standardwebhooks.ErrNoMatchingSignature))
	check("VerifyIgnoringTimestamp() rejects another secret",
		mustWebhook("whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX").
			VerifyIgnoringTimestamp([]byte(vBody), headers(vSig)) != nil)
	check("VerifyIgnoringTimestamp() accepts the vector among two signatures (rotation)",
		wh.VerifyIgnoringTimestamp([]byte(vBody),
			headers("v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= "+vSig)) == nil)
	check("VerifyIgnoringTimestamp() rejects when no signature matches",
		wh.VerifyIgnoringTimestamp([]byte(vBody),
			headers("v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")) != nil)

	if failures > 0 {
		fmt.Printf("standard-webhooks/libraries/go: %d check(s) FAILED\n", failures)
		return 1
	}
	fmt.Println("standard-webhooks/libraries/go: all checks passed")
	return 0
}

func main() {
	selfTestFlag := flag.Bool("self-test", false, "check the library against the test vector and exit")
	flag.Parse()
	if *selfTestFlag {
		os.Exit(selfTest())
	}
	secret := os.Getenv("WEBHOOK_SECRET")
	if secret == "" {
		log.Fatal("set WEBHOOK_SECRET=whsec_...")
	}
	wh, err := standardwebhooks.NewWebhook(secret)
	if err != nil {
		log.Fatal(err)
	}
	port := os.Getenv("PORT")
	if port == "" {
		port = "8000"
	}
	srv := &http.Server{
		Addr:              ":" + port,
		Handler:           handler(wh, &seenSet{ids: map[string]struct{}{}}),
		ReadHeaderTimeout: 10 * time.Second,
	}
	log.Printf("listening on :%s", port)
	log.Fatal(srv.ListenAndServe())
}
