#!/usr/bin/env python3
"""A minimal Streaming Hub webhook receiver (Python stdlib http.server + `standardwebhooks`).

    pip install -r requirements.txt      # standardwebhooks==1.1.0
    WEBHOOK_SECRET=whsec_... PORT=8000 python3 receiver.py
    python3 receiver.py --self-test      # checks the library against shared/VECTORS.md

What it does with each POST:
  1. verifies `webhook-signature` over the raw body with the Standard Webhooks library
     (any of the space-separated signatures may match: two are sent during a secret rotation;
     the library also rejects a `webhook-timestamp` more than 5 minutes off) -> 401 if it fails;
  2. answers the verification handshake (`X-Lerian-Event-Type: streaming_hub.verification`)
     by echoing the challenge;
  3. deduplicates on `X-Lerian-Event-Id` (stable across retries), acknowledges with 2xx at once
     and hands the event to a background worker.
"""
import json
import os
import queue
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks import Webhook

VERIFICATION_TYPE = "streaming_hub.verification"
MAX_BODY = 10 * 1024 * 1024

# Event ids already accepted. In memory for the example only: production should use a durable
# store shared by all instances (a database unique key, Redis SET NX with a TTL, ...), since
# retries can span ~28 hours and may reach another instance.
_seen: set = set()
_seen_lock = threading.Lock()
_work: "queue.Queue[tuple[str, dict, bytes]]" = queue.Queue()


def first_seen(event_id: str) -> bool:
    with _seen_lock:
        if event_id in _seen:
            return False
        _seen.add(event_id)
        return True


def worker() -> None:
    while True:
        event_id, headers, body = _work.get()
        # Real processing goes here (after the 2xx was sent). Make it idempotent too.
        print(f"processing {event_id} type={headers.get('x-lerian-event-type')} "
              f"attempt={headers.get('x-lerian-attempt')} bytes={len(body)}", flush=True)


def make_handler(wh: Webhook):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: bytes = b"", ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._reply(413, b"too large")
            body = self.rfile.read(length)  # raw bytes: verify these, not a re-serialisation
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                # json_parse=False: the body need not be JSON (Content-Type = ce-datacontenttype).
                wh.verify(body, headers, json_parse=False)
            except Exception:  # WebhookVerificationError, or a malformed header/body
                return self._reply(401, b"invalid signature")

            if headers.get("x-lerian-event-type") == VERIFICATION_TYPE:
                try:
                    challenge = json.loads(body)["challenge"]
                except (ValueError, KeyError, TypeError):
                    return self._reply(400, b"bad verification body")
                return self._reply(200, json.dumps({"challenge": challenge}).encode(),
                                   "application/json")

            event_id = headers.get("x-lerian-event-id") or headers["webhook-id"]
            if first_seen(event_id):
                _work.put((event_id, headers, body))
            self._reply(204)  # duplicates are acknowledged too, or the hub keeps retrying

        def log_message(self, fmt, *args):  # one short line per request
            sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    return Handler


# ---- self-test: shared/VECTORS.md, "Standard Webhooks signature (delivery side)" ----------
V_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
V_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
V_TS = 1614265330
V_BODY = b'{"test": 2432232314}'
V_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def self_test() -> int:
    from datetime import datetime, timezone

    import standardwebhooks
    import standardwebhooks.webhooks as sw

    failures = []

    def check(name, ok):
        print(("ok   " if ok else "FAIL ") + name)
        if not ok:
            failures.append(name)

    def verifies(body, sig, secret=V_SECRET):
        h = {"webhook-id": V_ID, "webhook-timestamp": str(V_TS), "webhook-signature": sig}
        try:
            Webhook(secret).verify(body, h, json_parse=False)
            return True
        except Exception:
            return False

    wh = Webhook(V_SECRET)
    check("sign() reproduces the vector signature",
          wh.sign(V_ID, datetime.fromtimestamp(V_TS, tz=timezone.utc), V_BODY.decode()) == V_SIG)

    # The vector is from 2021: outside the library's 5-minute tolerance, so first prove that it is
    # enforced, then pin the library's clock to the vector's timestamp for the signature checks.
    check("verify() rejects the vector at today's clock (timestamp tolerance)",
          not verifies(V_BODY, V_SIG))

    real_datetime = sw.datetime

    class PinnedClock(real_datetime):
        @classmethod
        def now(cls, tz=None):
            return real_datetime.fromtimestamp(V_TS, tz=tz)

    sw.datetime = PinnedClock
    try:
        check("verify() accepts the vector", verifies(V_BODY, V_SIG))
        check("verify() rejects a tampered body", not verifies(b'{"test": 2432232315}', V_SIG))
        check("verify() rejects another secret",
              not verifies(V_BODY, V_SIG, "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX"))
        check("verify() accepts the vector among two signatures (rotation)",
              verifies(V_BODY, "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= " + V_SIG))
        check("verify() rejects when no signature matches",
              not verifies(V_BODY, "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="))
    finally:
        sw.datetime = real_datetime

    print(f"standardwebhooks {standardwebhooks.__version__}: "
          f"{'all checks passed' if not failures else f'{len(failures)} check(s) FAILED'}")
    return 1 if failures else 0


def main() -> int:
    if "--self-test" in sys.argv[1:]:
        return self_test()
    secret = os.environ.get("WEBHOOK_SECRET")
    if not secret:
        print("set WEBHOOK_SECRET=whsec_...", file=sys.stderr)
        return 2
    port = int(os.environ.get("PORT", "8000"))
    threading.Thread(target=worker, daemon=True).start()
    server = ThreadingHTTPServer(("", port), make_handler(Webhook(secret)))
    print(f"listening on :{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
