"""`exactspec serve` end to end on loopback (exactspec.serving.api): the official openai client, streaming and
not, per-request seeds among concurrent streams, logprobs, stop strings, metrics, every refusal with an
OpenAI-style error body, a client that leaves mid-stream, a request that fails inside the model, and SIGTERM."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402

from exactspec import GREEDY, SpeculativeDecoder  # noqa: E402
from exactspec.decoding.seeds import sample_seed  # noqa: E402
from exactspec.jobs.records import model_identity, run_record  # noqa: E402
from exactspec.loading import default_pair_dirs, load_pair  # noqa: E402
from exactspec.serving.api import ServerSettings, create_app  # noqa: E402
from exactspec.speculator import build_engine  # noqa: E402

KEY = "test-key"
MODEL = "toy"
PROMPT = "def parse_args(argv):\n    "


@pytest.fixture(scope="module")
def pair():
    loaded = load_pair(*default_pair_dirs(), backend="lean", dtype=torch.float32)
    loaded.tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}<assistant> "
    return loaded


@pytest.fixture(scope="module")
def server(pair):
    engine = build_engine(pair, slots=8, max_len=512)
    record_base = run_record("serve", [], *default_pair_dirs(), None, "test", "fixed 4", None, "float32", {})
    app = create_app(
        engine,
        pair.tokenizer,
        ServerSettings(
            MODEL,
            api_key=KEY,
            max_tokens=256,
            max_n=4,
            max_sequences=24,
            max_request_bytes=20_000,
            record_base=record_base,
        ),
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.02)
    port = instance.servers[0].sockets[0].getsockname()[1]
    yield {"url": f"http://127.0.0.1:{port}", "engine": engine}
    instance.should_exit = True
    thread.join(timeout=10)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


def plain_greedy(pair, text: str, tokens: int) -> str:
    ids = pair.tokenizer.encode_prompt(text)
    out = SpeculativeDecoder(pair.target, None, GREEDY).generate(ids, max_new_tokens=tokens)
    return pair.tokenizer.decode(out.tokens)


def test_completion_streamed_and_not_equals_plain_greedy(client, pair):
    expected = plain_greedy(pair, PROMPT, 24)
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert result.choices[0].text == expected and result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 24 and result.usage.prompt_tokens == len(
        pair.tokenizer.encode_prompt(PROMPT)
    )
    figures = result.choices[0].model_extra["speculation"]
    assert figures["target_calls"] <= 24 and 0 <= figures["acceptance_rate"] <= 1
    pieces = [
        chunk.choices[0].text
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
        if chunk.choices
    ]
    assert "".join(pieces) == expected and len(pieces) > 1


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "write a loop"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 16
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and chunks[-1].usage.completion_tokens == 16


def test_eight_concurrent_seeded_streams_equal_their_solo_runs(client):
    def ask(seed: int) -> str:
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=32,
            temperature=1.0,
            seed=seed,
            stream=True,
            extra_body={"speculation": ["draft", "lookup", "off", "auto"][seed % 4]},
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    solo = [ask(seed) for seed in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == solo and len(set(solo)) > 1


def test_sampling_parameters_logprobs_stop_and_n(client, pair):
    expected = plain_greedy(pair, PROMPT, 24)
    stop = expected[6:9]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == expected[: expected.index(stop)] and stopped.choices[0].finish_reason == "stop"
    scored = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.7,
        logprobs=2,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2},
        seed=3,
        n=3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        logit_bias={"5": -100},
    )
    assert len(scored.choices) == 3
    for choice in scored.choices:
        lp = choice.logprobs
        assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
        assert all(len(top) == 2 for top in lp.top_logprobs)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}  # no key needed
    metrics = httpx.get(server["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in (
        "exactspec_tokens_per_second",
        "exactspec_acceptance_rate",
        "exactspec_mean_accepted_length",
        "exactspec_queue_depth",
        "exactspec_batch_size",
        'exactspec_speculation_decisions_total{decision="on"}',
    ):
        assert name in metrics
    generated = [line for line in metrics.splitlines() if line.startswith("exactspec_generated_tokens_total ")]
    assert float(generated[0].split()[1]) > 0


@pytest.mark.parametrize(
    "body, status, words",
    [
        ("{not json", 400, "not valid JSON"),
        ({"model": "other", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "speculation": "fast"}, 400, "speculation"),
        ({"model": MODEL, "prompt": "x", "verify": "blocks"}, 400, "verify"),
        ({"model": MODEL, "prompt": "x", "tempreature": 1}, 400, "tempreature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1000}, 400, "limit of 256"),
        ({"model": MODEL, "prompt": "x " * 600}, 400, "context window"),
        ({"model": MODEL, "prompt": "x " * 300, "max_tokens": 256}, 400, "exceeds the context window of 512"),
        ({"model": MODEL, "prompt": "x", "n": 5}, 400, "n 5 exceeds"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "token ids"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "y" * 30_000}, 413, "exceeds 20000"),
        ({"model": MODEL, "prompt": "x", "stream": True, "return_token_ids": True}, 400, "not with stream"),
    ],
)
def test_bad_requests_get_openai_style_errors(server, body, status, words):
    data = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        server["url"] + "/v1/completions",
        content=data,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"] and error["type"]


def test_token_ids_and_the_run_record_on_request(server, pair):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "n": 2,
        "seed": 5,
        "top_k": 30,
        "speculation": "draft",
        "return_token_ids": True,
        "return_record": True,
    }
    response = httpx.post(
        server["url"] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    choices, record = response["choices"], response["record"]
    assert choices[0]["prompt_token_ids"] == pair.tokenizer.encode_prompt(PROMPT)
    assert [pair.tokenizer.decode(c["token_ids"]) for c in choices] == [c["text"] for c in choices]
    assert [c["token_ids"] for c in record["figures"]["choices"]] == [c["token_ids"] for c in choices]
    assert (
        record["seed"] == [5, sample_seed(5, 1)]
        and record["sampling"] == [["top_k", 30]]
        and record["speculation"] == "draft"
    )
    assert record["target"] == model_identity(default_pair_dirs()[0]) and record["kind"] == "served request"
    assert record["verify"] == "block" and record["draw_order_version"] == 2
    body.update(verify="token", n=1)
    record = httpx.post(
        server["url"] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ).json()["record"]
    assert record["verify"] == "token" and record["draw_order_version"] == 1 and "first rejection" in record["residual"]


def test_a_missing_or_wrong_key_is_refused(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_a_client_that_leaves_mid_stream_frees_its_slot(server, client):
    engine = server["engine"]
    with httpx.stream(
        "POST",
        server["url"] + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 250, "stream": True, "temperature": 0},
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    cancelled_before = engine.metrics.finished["cancelled"]
    for _ in range(200):
        if engine.batch_size == 0 and engine.metrics.finished["cancelled"] >= max(1, cancelled_before):
            break
        time.sleep(0.05)
    assert engine.batch_size == 0 and engine.metrics.finished["cancelled"] >= 1
    assert (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).usage.completion_tokens == 4
    )


def test_a_request_that_fails_inside_the_model_gets_500_and_the_server_goes_on(client, monkeypatch):
    import exactspec.decoding.engine as module

    real = module.block_probs
    monkeypatch.setattr(
        module,
        "block_probs",
        lambda logits, prefix, block, n, params, **columns: (
            (_ for _ in ()).throw(RuntimeError("injected fault"))
            if params.top_k == 7
            else real(logits, prefix, block, n, params, **columns)
        ),
    )
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"top_k": 7})
    assert (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).usage.completion_tokens == 8
    )


def test_sigterm_finishes_cleanly(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "exactspec", "serve", "--port", str(port), "--max-batch", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        done = {}

        def stream():
            with httpx.stream(
                "POST",
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=60,
                json={"model": "exactspec-default", "prompt": PROMPT, "max_tokens": 600, "stream": True},
            ) as response:
                done["lines"] = [line for line in response.iter_lines() if line]

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        assert done["lines"][-1] == "data: [DONE]"  # the in-flight stream was finished, not cut
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--host", "0.0.0.0"], "give it an --api-key"),
        (["--backend", "hf"], "--backend hf is for generate"),
    ],
)
def test_serve_refuses_unsafe_or_unsupported_settings_in_one_line(flags, words, capsys):
    from exactspec.cli import main

    code = main(["serve", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1
