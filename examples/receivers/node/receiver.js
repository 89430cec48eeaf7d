#!/usr/bin/env node
// A minimal Streaming Hub webhook receiver (Node `http` + `standardwebhooks`).
//
//   npm ci                                   # standardwebhooks pinned in package.json
//   WEBHOOK_SECRET=whsec_... PORT=8000 node receiver.js
//   node receiver.js --self-test             # checks the library against shared/VECTORS.md
//
// What it does with each POST:
//   1. verifies `webhook-signature` over the raw body with the Standard Webhooks library (any of
//      the space-separated signatures may match: two are sent during a secret rotation; the
//      library also rejects a `webhook-timestamp` more than 5 minutes off) -> 401 if it fails;
//   2. answers the verification handshake (`X-Lerian-Event-Type: streaming_hub.verification`)
//      by echoing the challenge;
//   3. deduplicates on `X-Lerian-Event-Id` (stable across retries), acknowledges with 2xx at
//      once and processes the event afterwards.
"use strict";
const http = require("node:http");
const { Webhook } = require("standardwebhooks");

const VERIFICATION_TYPE = "streaming_hub.verification";
const MAX_BODY = 10 * 1024 * 1024;

// Event ids already accepted. In memory for the example only: production should use a durable
// store shared by all instances (a database unique key, Redis SET NX with a TTL, ...), since
// retries can span ~28 hours and may reach another instance.
const seen = new Set();

function processEvent(eventId, headers, body) {
  // Real processing goes here (after the 2xx was sent). Make it idempotent too.
  console.log(
    `processing ${eventId} type=${headers["x-lerian-event-type"]} ` +
      `attempt=${headers["x-lerian-attempt"]} bytes=${body.length}`,
  );
}

function handler(wh) {
  return (req, res) => {
    const reply = (status, body = "", type = "text/plain") => {
      res.writeHead(status, { "Content-Type": type }).end(body);
    };
    if (req.method !== "POST") return reply(405, "POST only");
    const chunks = [];
    let size = 0;
    req.on("data", (c) => {
      size += c.length;
      if (size > MAX_BODY) {
        reply(413, "too large");
        req.destroy();
      } else chunks.push(c);
    });
    req.on("end", () => {
      if (size > MAX_BODY) return;
      const body = Buffer.concat(chunks); // raw bytes: verify these, not a re-serialisation
      try {
        // jsonParse: false, the body need not be JSON (Content-Type = ce-datacontenttype).
        wh.verify(body, req.headers, { jsonParse: false });
      } catch {
        return reply(401, "invalid signature");
      }

      if (req.headers["x-lerian-event-type"] === VERIFICATION_TYPE) {
        let challenge;
        try {
          challenge = JSON.parse(body.toString("utf8")).challenge;
        } catch {
          return reply(400, "bad verification body");
        }
        return reply(200, JSON.stringify({ challenge }), "application/json");
      }

      const eventId = req.headers["x-lerian-event-id"] || req.headers["webhook-id"];
      reply(204); // duplicates are acknowledged too, or the hub keeps retrying
      if (!seen.has(eventId)) {
        seen.add(eventId);
        setImmediate(() => processEvent(eventId, req.headers, body));
      }
    });
  };
}

// ---- self-test: shared/VECTORS.md, "Standard Webhooks signature (delivery side)" -----------
const V = {
  secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
  id: "msg_p5jXN8AQM9LWM0D4loKWxJek",
  ts: 1614265330,
  body: '{"test": 2432232314}',
  sig: "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
};

function selfTest() {
  const failures = [];
  const check = (name, ok) => {
    console.log(`${ok ? "ok  " : "FAIL"} ${name}`);
    if (!ok) failures.push(name);
  };
  const verifies = (body, sig, secret = V.secret) => {
    const headers = {
      "webhook-id": V.id,
      "webhook-timestamp": String(V.ts),
      "webhook-signature": sig,
    };
    try {
      new Webhook(secret).verify(Buffer.from(body), headers, { jsonParse: false });
      return true;
    } catch {
      return false;
    }
  };

  const wh = new Webhook(V.secret);
  check(
    "sign() reproduces the vector signature",
    wh.sign(V.id, new Date(V.ts * 1000), Buffer.from(V.body)) === V.sig,
  );

  // The vector is from 2021: outside the library's 5-minute tolerance, so first prove that it is
  // enforced, then pin the clock to the vector's timestamp for the signature checks.
  check("verify() rejects the vector at today's clock (timestamp tolerance)", !verifies(V.body, V.sig));
  const realNow = Date.now;
  Date.now = () => V.ts * 1000;
  try {
    check("verify() accepts the vector", verifies(V.body, V.sig));
    check("verify() rejects a tampered body", !verifies('{"test": 2432232315}', V.sig));
    check(
      "verify() rejects another secret",
      !verifies(V.body, V.sig, "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX"),
    );
    check(
      "verify() accepts the vector among two signatures (rotation)",
      verifies(V.body, `v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= ${V.sig}`),
    );
    check(
      "verify() rejects when no signature matches",
      !verifies(V.body, "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="),
    );
  } finally {
    Date.now = realNow;
  }

  const version = require("standardwebhooks/package.json").version;
  console.log(
    `standardwebhooks ${version}: ${failures.length ? `${failures.length} check(s) FAILED` : "all checks passed"}`,
  );
  return failures.length ? 1 : 0;
}

function main() {
  if (process.argv.includes("--self-test")) process.exit(selfTest());
  const secret = process.env.WEBHOOK_SECRET;
  if (!secret) {
    console.error("set WEBHOOK_SECRET=whsec_...");
    process.exit(2);
  }
  const port = Number(process.env.PORT || 8000);
  http.createServer(handler(new Webhook(secret))).listen(port, () => {
    console.log(`listening on :${port}`);
  });
}

main();
