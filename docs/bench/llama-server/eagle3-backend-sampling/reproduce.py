"""Where does llama-server's draft-eagle3 lose acceptance when sequences share a batch? 8 grounded prompts, greedy,
all at once, with draft backend sampling on (default) and off; per-response drafted/accepted and per-slot lines."""
import json, subprocess, sys, time, urllib.request, concurrent.futures as cf, socket
from exactspec.bench.workloads import workload_prompts
from exactspec.tokenizer import TextTokenizer
from exactspec.loading import resolve_checkpoint

gguf = str(resolve_checkpoint("smollm2"))
tok = TextTokenizer.from_path(gguf)
prompts = [tok.encode_chat([{"role": "user", "content": p}])[-400:] for p in workload_prompts("grounded", 8)]

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())

def run(extra, together):
    port = free_port()
    log = open(f"/work/runs/overlap/server-{'-'.join(extra) or 'default'}-{together}.log", "w")
    cmd = ["/tmp/lcb/build/bin/llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", "8",
           "--threads", "1", "--spec-type", "draft-eagle3", "--model-draft", "/work/runs/export_d/draft.gguf",
           "--spec-draft-n-max", "3", "--spec-draft-p-min", "0", *extra]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2); break
            except Exception:
                time.sleep(0.5)
        bodies = [{"prompt": ids, "n_predict": 48, "temperature": 0, "cache_prompt": False, "seed": i} for i, ids in enumerate(prompts)]
        if together:
            with cf.ThreadPoolExecutor(8) as pool:
                out = list(pool.map(lambda b: post(port, b), bodies))
        else:
            out = [post(port, b) for b in bodies]
    finally:
        server.terminate(); server.wait()
    drafted = sum(r["timings"].get("draft_n", 0) for r in out)
    accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in out)
    per = [(r.get("id_slot"), r["timings"].get("draft_n", 0), r["timings"].get("draft_n_accepted", 0)) for r in out]
    return {"extra": extra, "together": together, "drafted": drafted, "accepted": accepted, "per_response": per,
            "tokens": [r.get("tokens") for r in out]}

results = [run(extra, together) for extra in ([], ["--no-spec-draft-backend-sampling"]) for together in (False, True)]
json.dump(results, open("/work/runs/overlap/results.json", "w"))
for r in results:
    print(r["extra"], "together" if r["together"] else "one at a time", r["drafted"], r["accepted"], r["per_response"])
