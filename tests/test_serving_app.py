"""The server's handlers called alone, without HTTP routing (exactspec.serving.api.ServingApp): each refuses what
it must with the status and parameter an OpenAI client reads, and answers what it should, before any engine runs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")

from exactspec.decoding.seeds import sample_seed  # noqa: E402
from exactspec.loading import default_pair_dirs, load_pair  # noqa: E402
from exactspec.serving.api import ApiError, ServerSettings, ServingApp  # noqa: E402
from exactspec.serving.protocol import CompletionRequest  # noqa: E402
from exactspec.speculator import build_engine  # noqa: E402


@pytest.fixture(scope="module")
def serving():
    pair = load_pair(*default_pair_dirs(), backend="lean", dtype=torch.float32)
    engine = build_engine(pair, slots=2, max_len=64, calibrated=False)
    return ServingApp(engine, pair.tokenizer, ServerSettings("toy", max_tokens=32, max_n=2, max_sequences=2))


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "toy", "prompt": "x", **fields})


def refusal(call) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call()
    return caught.value


def test_sequences_checks_every_limit_and_builds_one_request_per_choice(serving):
    assert refusal(lambda: serving.sequences(completion(max_tokens=33), [1, 2], 16)).param == "max_tokens"
    assert refusal(lambda: serving.sequences(completion(n=3), [1, 2], 16)).param == "n"
    assert refusal(lambda: serving.sequences(completion(max_tokens=8), list(range(60)), 16)).param == "max_tokens"
    assert refusal(lambda: serving.sequences(completion(), list(range(64)), 16)).param == "prompt"
    bad_bias = refusal(lambda: serving.sequences(completion(logit_bias={"999999": 1}), [1], 16))
    assert bad_bias.status == 400 and "outside the vocabulary" in bad_bias.message
    requests = serving.sequences(completion(n=2, seed=7, max_tokens=5, temperature=0.5), [1, 2], 16)
    assert [r.seed for r in requests] == [7, sample_seed(7, 1)] and {r.max_new_tokens for r in requests} == {5}
    assert all(r.prompt == (1, 2) and r.params.temperature == 0.5 for r in requests)


def test_prompt_ids_refuses_empty_prompts_and_ids_outside_the_vocabulary(serving):
    vocab = serving.engine.target.vocab_size
    assert refusal(lambda: serving.prompt_ids(completion(prompt=[0, vocab]), chat=False)).param == "prompt"
    assert refusal(lambda: serving.prompt_ids(completion(prompt=[]), chat=False)).message == "the prompt is empty"
    assert serving.prompt_ids(completion(prompt=[3, 4]), chat=False) == [3, 4]


def test_start_refuses_past_the_sequences_in_flight_and_counts_what_it_takes(serving):
    async def take(count: int):
        return serving.start(serving.sequences(completion(n=count, max_tokens=1), [1], 16), [])

    serving.counters.sequences = 1
    assert refusal(lambda: asyncio.run(take(2))).status == 429
    assert serving.counters.requests == 0
    serving.counters.sequences = 0
    choices = asyncio.run(take(2))
    assert len(choices) == 2 and serving.counters.sequences == 2 and serving.counters.requests == 1
    for choice in choices:
        choice.handle.cancel()


def test_models_names_the_served_model_and_its_window(serving):
    listing = asyncio.run(serving.models())
    assert [m["id"] for m in listing["data"]] == ["toy"] and listing["data"][0]["max_model_len"] == 64


def test_parse_refuses_another_models_name_with_404(serving):
    request = SimpleNamespace(body=lambda: _bytes(b'{"model": "other", "prompt": "x"}'))
    error = refusal(lambda: asyncio.run(serving.parse(request, CompletionRequest)))
    assert error.status == 404 and error.code == "model_not_found"


async def _bytes(value: bytes) -> bytes:
    return value
