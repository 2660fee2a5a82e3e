"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import collections
import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The adaptive policy's per-pair cache: never the user's own, for every test and the processes they start.
os.environ["EXACTSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="exactspec-test-cache-")


def random_distribution(generator: torch.Generator, vocab: int, kind: str = "dense") -> torch.Tensor:  # (V,)
    """A float64 distribution of a given kind: dense, sparse (some exact zeros), one-hot or near-zero entries."""
    if kind == "dense":
        weights = torch.rand(vocab, dtype=torch.float64, generator=generator) + 1e-3
    elif kind == "sparse":
        weights = torch.rand(vocab, dtype=torch.float64, generator=generator)
        weights[torch.rand(vocab, generator=generator) < 0.5] = 0
        weights[torch.randint(vocab, (1,), generator=generator)] = 1.0
    elif kind == "one_hot":
        weights = torch.zeros(vocab, dtype=torch.float64)
        weights[torch.randint(vocab, (1,), generator=generator)] = 1.0
    elif kind == "tiny":
        weights = torch.rand(vocab, dtype=torch.float64, generator=generator)
        weights[torch.rand(vocab, generator=generator) < 0.5] *= 1e-13
        weights[torch.randint(vocab, (1,), generator=generator)] = 1.0
    else:
        raise ValueError(kind)
    return weights / weights.sum()


def disjoint_pair(generator: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two distributions with disjoint supports (vocab >= 2)."""
    split = int(torch.randint(1, vocab, (1,), generator=generator))
    p = torch.zeros(vocab, dtype=torch.float64)
    q = torch.zeros(vocab, dtype=torch.float64)
    p[:split] = torch.rand(split, dtype=torch.float64, generator=generator) + 0.1
    q[split:] = torch.rand(vocab - split, dtype=torch.float64, generator=generator) + 0.1
    return p / p.sum(), q / q.sum()


# The suite's tensors are tiny: one thread avoids oversubscription on a 2-core machine.
torch.set_num_threads(1)


def save_tiny_checkpoint(path, vocab_rows: int, layers: int, seed: int, tokenizer_json: str | None = None):
    """A random Llama checkpoint in Hugging Face format (config.json + safetensors [+ tokenizer.json])."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_rows,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a wider init than HF's so that the distributions are far from uniform
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(path)
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(tokenizer_json)
    return path


def tiny_tokenizer_json(extra_text: str = "") -> str:
    """A byte-level BPE tokenizer trained in milliseconds on a few lines of Python."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = ["def parse_args(argv):\n    return argv[1:]\n", "import os\nprint(os.getcwd())\n" + extra_text] * 20
    tokenizer.train_from_iterator(text, trainer)
    return tokenizer.to_str()


class SyntheticClock:
    """A policy as the engine sees it, told call costs from a formula instead of the (microsecond, noisy) Markov
    timings; ``chosen`` records every gamma it picked."""

    def __init__(self, policy, draft_ms: float, target_ms_of) -> None:
        self.policy, self.draft_ms, self.target_ms_of = policy, draft_ms, target_ms_of
        self.chosen: list[int] = []

    def choose(self, sources, fixed_rows=0, fixed_tokens=0.0) -> int:
        self.chosen.append(self.policy.choose(sources, fixed_rows, fixed_tokens))
        return self.chosen[-1]

    def expected_tokens(self, source, gamma) -> float:
        return self.policy.expected_tokens(source, gamma)

    def observe_round(self, source, record) -> None:
        self.policy.observe_round(source, record)

    def observe_target(self, rows, seconds) -> None:
        self.policy.observe_target(rows, self.target_ms_of(rows) / 1000)

    def observe_draft(self, sources, seconds_per_step) -> None:
        self.policy.observe_draft(sources, self.draft_ms / 1000)


def engine_outcomes(
    engine,
    prompt,
    n: int,
    params,
    new_tokens: int,
    gamma: int | str,
    speculation: str = "draft",
    offset: int = 0,
    verify: str = "block",
    stops: frozenset[int] = frozenset(),
) -> list[tuple[int, ...]]:
    """The tokens of ``n`` sequences of ``prompt`` (seeds offset..offset+n-1, in seed order) drawn through one batch
    engine with every slot busy. A seeded sequence draws from its own generator, so this is the experiment of n solo
    runs (the law of each sequence is the target's whatever its neighbours: test_serving_engine) in far fewer calls."""
    from exactspec.decoding.engine import SequenceRequest

    outcomes, finished = [[] for _ in range(n)], []
    for i in range(n):
        engine.submit(
            SequenceRequest(
                prompt=tuple(prompt),
                params=params,
                max_new_tokens=new_tokens,
                stop_token_ids=stops,
                seed=offset + i,
                speculation=speculation,
                gamma=gamma,
                verify=verify,
            ),
            lambda events, out=outcomes[i]: out.extend(e.token for e in events),
            finished.append,
        )
    while len(finished) < n:
        engine.step()
    if any(h.finish_reason == "error" for h in finished):
        raise next(h.exception for h in finished if h.finish_reason == "error")
    return [tuple(tokens) for tokens in outcomes]


def engine_counts(*args, **kwargs) -> dict[tuple[int, ...], int]:
    """Outcome counts of :func:`engine_outcomes`."""
    return dict(collections.Counter(engine_outcomes(*args, **kwargs)))


def sequence_law(next_probs, prompt, new_tokens: int) -> dict[tuple[int, ...], float]:
    """P(the next ``new_tokens`` tokens = s) for every s with P > 0, by walking the tree of prefixes once:
    ``next_probs(prefix)`` gives the next token's distribution ``(V,)`` after ``prefix`` (prompt included)."""
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], generated: tuple[int, ...], prob: float) -> None:
        if len(generated) == new_tokens:
            law[generated] = prob
            return
        probs = next_probs(prefix)
        for token in torch.nonzero(probs > 0).flatten().tolist():
            walk(prefix + [token], generated + (token,), prob * float(probs[token]))

    walk(list(prompt), (), 1.0)
    return law


@pytest.fixture
def fake_llama_server(tmp_path) -> Path:
    """An executable that runs the llama-server stand-in (fake_llama_server.py) as the real binary would be run."""
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).with_name("fake_llama_server.py")} "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def installed_llama_server() -> Path | None:
    """The real llama-server where one is installed (exactspec.bench.llama_server.find_llama_server), else None."""
    from exactspec.bench.llama_server import find_llama_server

    try:
        return find_llama_server()
    except FileNotFoundError:
        return None
