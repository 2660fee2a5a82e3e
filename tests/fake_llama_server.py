"""A stand-in for llama-server in tests where the real one is not installed: the flags exactspec passes, /health and
/completion. Its answers are a fixed function of the request (no model): token i of a completion is
``(sum(prompt) + i) % 7``, one more with a --spec-type, where every other token counts as an accepted draft; the
request's body and the server's command line come back in the answer, so a test sees what was sent.

Environment: FAKE_LLAMA_SERVER_FAIL=1 (or =MODE: only with --spec-type MODE) exits at start with llama-server's
message for a bad model file;
FAKE_LLAMA_SERVER_NO_TOKENS=1 answers without token ids; FAKE_LLAMA_SERVER_BODIES=FILE appends each request's body
and the server's --spec-type to FILE, one JSON line each; FAKE_LLAMA_SERVER_CRASH_WITHOUT_NO_REPACK=request (or =start)
dies of SIGSEGV in the middle of answering a request (or at start) unless started with --no-repack, as a GCC 12 build's
AMX kernels do.
"""

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if "--version" in sys.argv:
    print("version: 1 (fake)\nbuilt with a test for a test")
    raise SystemExit(0)
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--host", required=True)
parser.add_argument("--spec-type", default=None)
known, _ = parser.parse_known_args()
CRASH = os.environ.get("FAKE_LLAMA_SERVER_CRASH_WITHOUT_NO_REPACK") if "--no-repack" not in sys.argv else None
if CRASH == "start":
    os.kill(os.getpid(), signal.SIGSEGV)
if os.environ.get("FAKE_LLAMA_SERVER_FAIL") in ("1", known.spec_type or "plain"):
    print("llama_model_load: error loading model: failed to read the file", flush=True)
    raise SystemExit(1)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer(200, {"status": "ok"}) if self.path == "/health" else self._answer(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if os.environ.get("FAKE_LLAMA_SERVER_BODIES"):
            with open(os.environ["FAKE_LLAMA_SERVER_BODIES"], "a") as log:
                log.write(json.dumps({"spec_type": known.spec_type, "body": body}) + "\n")
        if CRASH == "request":  # dies mid-answer: the headers are out, the body never comes
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.flush()
            os.kill(os.getpid(), signal.SIGSEGV)
            threading.Event().wait()  # the signal may land on another thread: this one writes nothing more
        n = body["n_predict"]
        tokens = [(sum(body["prompt"]) + i + bool(known.spec_type)) % 7 for i in range(n)]
        accepted = n // 2 if known.spec_type else 0
        answer = {
            "content": "x" * n,
            "timings": {"predicted_n": n, **({"draft_n": n, "draft_n_accepted": accepted} if accepted else {})},
            "received": body,
            "argv": sys.argv[1:],
        }
        if not os.environ.get("FAKE_LLAMA_SERVER_NO_TOKENS"):
            answer["tokens"] = tokens
        self._answer(200, answer)


print("main: server is listening", flush=True)
ThreadingHTTPServer((known.host, known.port), Handler).serve_forever()
