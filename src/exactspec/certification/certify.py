"""``exactspec certify``: a statistical test that a model pair's speculative output follows the target's law.

Per sampling configuration:

1. sample: ``sequences`` continuations of ``max_tokens`` tokens with the draft at a fixed gamma, through the
   server's batch engine (:mod:`exactspec.decoding.engine`), each sequence seeded; every token is tagged with its
   position in its round and whether it was an accepted draft token or the round's replacement/bonus token;
2. score: a plain cache-free target forward of each whole sequence (the prompt's positions computed once for all
   its sequences, :func:`shared_prompt_logits`) gives the target's processed distribution at every generated position
   (:func:`exactspec.decoding.sampling.block_probs` on the prefix of that position), and each token's randomized PIT
   value (:mod:`.pit`);
3. test: uniformity (Kolmogorov-Smirnov) of all PIT values and of those at each position in the round, and a
   chi-square goodness of fit of the next token after every prefix seen often enough, per prefix depth
   (:mod:`.pit` says which subsets are valid); Holm over every test of every configuration, so the family-wise
   false-positive rate is ``alpha``.

Beside the statistics, every sampled draft token's draw is replayed (:class:`_RecordsDraftProbs`): the inverse-CDF
draw from the q reported to the verifier, at the uniform the sequence's generator gave, must be the token proposed.
A mismatch proves the draft was drawn from another distribution than the one checked, a bug too small for any
feasible sample of the tests (drafts drawn in one precision and checked in another: about 0.001 TV per token).

Greedy decoding is checked apart: speculative greedy output must equal plain greedy output. Numerics are
measured beside the verdict: the largest logit difference between a position computed alone and inside a block
of gamma + 1 tokens, in the mode the pair runs in (the scoring forward is another call shape, so a mode whose
logits move with the call shape by more than the test's resolution would show up as a rejection; float32, the
default here, moves them by about 1e-5). ``self_check`` reruns the sampling with each known-wrong engine
(:mod:`.mutants`) and reports whether the same tests reject it.
"""

from __future__ import annotations

import ctypes
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from exactspec.bench.workloads import CHAT_WORKLOADS, workload_prompts
from exactspec.certification.mutants import MUTANTS, applies
from exactspec.certification.pit import (
    TestResult,
    binned_uniform,
    holm,
    ks_critical_value,
    ks_uniform,
    p_order_masses,
    pit_values,
    ratio_pit_values,
    recency_pit_values,
    token_goodness_of_fit,
)
from exactspec.chat import chat_messages
from exactspec.decoding.block import check_rule
from exactspec.decoding.decoder import SpeculativeDecoder
from exactspec.decoding.engine import BatchEngine, EngineConfig, SequenceRequest
from exactspec.decoding.sampling import GREEDY, SamplingParams, block_probs
from exactspec.decoding.verify import sample_from
from exactspec.loading import LoadedPair
from exactspec.speculator import build_engine
from exactspec.tokenizer import TextTokenizer

__all__ = [
    "AUDIT_CONFIGS",
    "CONFIGS",
    "MIN_TEST_TOKENS",
    "CertifyConfig",
    "LocalSampler",
    "certify",
    "default_prompts",
    "drafting",
    "merge_scored",
    "precision_mode",
    "run_tests",
    "score_runs",
    "shared_prompt_logits",
]

CONFIGS = {
    "T=1": SamplingParams(),
    "T=0.8 top_k=50": SamplingParams(temperature=0.8, top_k=50),
    "top_p=0.9": SamplingParams(top_p=0.9),
    "T=1.2 min_p=0.05": SamplingParams(temperature=1.2, min_p=0.05),
    "penalties": SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
}
#: For an audit: the certification's configurations, and two that servers' users often set: a temperature with top-k and
#: top-p together, and the repetition penalty alone (the one penalty whose law llama-server shares).
AUDIT_CONFIGS = {
    **CONFIGS,
    "T=0.8 top_k=50 top_p=0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "repetition_penalty=1.3": SamplingParams(repetition_penalty=1.3),
}
MIN_TEST_TOKENS = 20  # the fewest PIT values a uniformity test is run on
PREFIX_DEPTH = 6  # deepest prefix whose next-token counts are tested
MIN_PREFIX_COUNT = 30  # a prefix seen fewer times is left to the PIT tests
#: The configuration each known-wrong engine is run with in the self-check: one where its bug changes the law
#: (an unprocessed q is the processed one at T=1 without truncation).
MUTANT_CONFIG = {
    "residual_from_p": "T=1",
    "unprocessed_q": "T=0.8 top_k=50",
    "penalties_once_per_round": "penalties",
    "argmax_draft_sampled_ratio": "T=1",
    "precision_mismatch": "T=1",
    "block_tokenwise_residual": "T=1",
    "block_first_failure": "T=1",
    "block_shared_uniform": "T=1",
    "block_uncapped_weight": "T=1",
    "block_no_denominator": "T=1",
}


@dataclass(frozen=True)
class CertifyConfig:
    configs: tuple[str, ...] = tuple(CONFIGS)
    sequences: int = 400  # per configuration
    max_tokens: int = 48
    gamma: int = 4
    alpha: float = 1e-3  # family-wise false-positive rate
    seed: int = 0
    slots: int = 128  # sequences sampled together: 32 to 128 sped SmolLM2 sampling up by a quarter (2 threads)
    self_check: bool = False
    mutants: tuple[str, ...] = tuple(MUTANTS)  # which known-wrong samplers the self-check runs
    verify: str = "block"  # the rule for sampled drafts (the block rule's mutants apply only to it)

    def __post_init__(self) -> None:
        check_rule(self.verify)
        unknown = set(self.configs) - set(CONFIGS)
        if unknown or not self.configs:
            raise ValueError(f"configs must be among {', '.join(CONFIGS)}, got {', '.join(self.configs)}")
        if set(self.mutants) - set(MUTANTS):
            raise ValueError(f"mutants must be among {', '.join(MUTANTS)}, got {', '.join(self.mutants)}")
        if self.sequences < 1 or self.max_tokens < 1 or self.gamma < 1 or self.slots < 1:
            raise ValueError("sequences, max_tokens, gamma and slots must be >= 1")
        if self.sequences * self.max_tokens < MIN_TEST_TOKENS:
            raise ValueError(
                f"sequences x max_tokens is {self.sequences * self.max_tokens}; "
                f"a test needs at least {MIN_TEST_TOKENS} tokens"
            )
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")


ORDERS = ("token id", "p", "recency", "q/p")  # orders of the vocabulary the PIT is taken in (see .pit)
TOP_Q = 64  # the draft's most likely tokens kept per drafted position for the q/p order (the rest count as q = 0)


class _RecordsDraftProbs:
    """Mixed into the sampling engine. Keeps, per sequence and position, the most likely tokens of the q each drafted
    position was verified with (known before the position's token is drawn, so a valid order for its PIT). And
    replays each sampled draft token's draw: from the sequence's generator state before the round's drafting, in the
    engine's draw order (one uniform per draft token, in order), the inverse-CDF draw from the reported q
    (:func:`exactspec.decoding.verify.sample_from`, the engine's own sampler) must be the token proposed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded_q: dict = {}
        self.draws = {
            "replayed": 0,
            "mismatched": 0,
        }  # sampled draft tokens replayed; those the reported q does not draw

    def _draft(self, sequences, gammas):
        self._draft_states = {s.slot: s.generator.get_state() for s in sequences}
        return super()._draft(sequences, gammas)

    def _round_end(self, s, row, logits, round_):
        tokens, probs = round_.draft.tokens, round_.draft.probs
        if probs is not None:  # (g, V), zero outside the draft's columns: only those are searched
            ids = getattr(s.proposer, "token_ids", None)
            columns = probs if ids is None else probs[:, ids]
            top = columns.topk(min(TOP_Q, columns.shape[-1]), dim=-1)
            ids = top.indices if ids is None else ids[top.indices]
            for k in range(len(tokens)):
                self.recorded_q[(s.request.seed, len(s.context) + k)] = (ids[k], top.values[k])
            replay = torch.Generator()
            replay.set_state(self._draft_states[s.slot])
            uniforms = torch.cat([torch.rand((1,), dtype=torch.float64, generator=replay) for _ in tokens])
            self.draws["replayed"] += len(tokens)
            self.draws["mismatched"] += int((sample_from(probs, uniforms) != torch.tensor(tokens)).sum())
        super()._round_end(s, row, logits, round_)


def _recording_engine(
    pair: LoadedPair, config: CertifyConfig, max_len: int, engine_class: type[BatchEngine] = BatchEngine
) -> BatchEngine:
    recording = type(f"Recording{engine_class.__name__}", (_RecordsDraftProbs, engine_class), {})
    return build_engine(
        pair, config.slots, max_len, EngineConfig(gamma=config.gamma), calibrated=False, engine_class=recording
    )


def _sample(
    engine: BatchEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    config: CertifyConfig,
    seed: int,
    progress: tqdm,
    indices: range | None = None,
) -> list[dict]:
    """Seeded speculative continuations (sequence i: prompt i mod len(prompts), seed + i; default: all sequences)
    with each token's round position and kind, and the q of drafted positions."""
    engine.recorded_q.clear()
    engine.draws.update(replayed=0, mismatched=0)
    indices = range(config.sequences) if indices is None else indices
    runs = [{"prompt": prompts[i % len(prompts)], "seed": seed + i, "events": []} for i in indices]
    speculation = "lookup" if engine.proposer is None else "draft"
    handles = []
    for run in runs:
        request = SequenceRequest(
            prompt=tuple(run["prompt"]),
            params=params,
            max_new_tokens=config.max_tokens,
            seed=run["seed"],
            speculation=speculation,
            verify=config.verify,
        )
        handles.append(
            engine.submit(
                request,
                lambda events, run=run: (run["events"].extend(events), progress.update(len(events))),
                lambda h: None,
            )
        )
    while any(h.finish_reason is None for h in handles):
        engine.step()
    failed = [h.error for h in handles if h.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"sampling failed: {failed[0]}")
    for run in runs:
        start, events = len(run["prompt"]), run.pop("events")
        run.update(
            tokens=[e.token for e in events],
            positions=[e.round_position for e in events],
            kinds=[e.kind for e in events],
            q=[engine.recorded_q.get((run["seed"], start + i)) for i in range(len(events))],
        )
    return runs


def _order_pits(
    probs: torch.Tensor, prefix: list[int], tokens: list[int], q: list, uniforms: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per order (:data:`ORDERS`), the PIT value ``(n,)`` of each generated position (NaN where the order does not
    apply: q / p at positions nobody drafted). ``probs`` ``(n, V)``: the target's processed distributions."""
    token_ids, mass = torch.tensor(tokens), probs.sum(-1)
    p_masses = p_order_masses(probs, token_ids)
    pits = {
        "token id": pit_values(probs, token_ids, uniforms),
        "p": (p_masses[0] + uniforms * p_masses[1]).clamp(0.0, 1.0),
        "recency": recency_pit_values(probs, token_ids, uniforms, prefix, p_masses, mass),
        "q/p": torch.full((len(tokens),), float("nan"), dtype=torch.float64),
    }
    drafted = [i for i in range(len(tokens)) if q[i] is not None]
    if drafted:
        q_ids, q_values = torch.stack([q[i][0] for i in drafted]), torch.stack([q[i][1] for i in drafted])
        drafted = torch.tensor(drafted)
        p_recorded = probs[drafted.unsqueeze(1), q_ids]  # (d, K)
        pits["q/p"][drafted] = ratio_pit_values(
            p_recorded, mass[drafted], token_ids[drafted], uniforms[drafted], q_ids, q_values
        )
    return pits


def continuation_mask(
    prompt_length: int, width: int, device: torch.device | str = "cpu"
) -> torch.Tensor:  # (W, P + W) bool
    """Continuation position i sees the whole prompt and its own positions up to i."""
    own = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones((width, prompt_length), dtype=torch.bool, device=device), own], dim=1)


def shared_prompt_logits(decoder, prompt: list[int], continuations: list[list[int]]) -> torch.Tensor:  # (B, 1 + W, V)
    """The target's logits after the prompt and after each token of each continuation (right-padded to the longest,
    W), from a cache-free causal forward in which the prompt's positions run once: each layer computes the prompt's
    keys and values and every continuation attends to them and, causally, to its own (padding follows a row's real
    tokens, so no real position sees it). It shares no code with the engine's caches (only the layers' maths)."""
    device, b, p = decoder.embed.weight.device, len(continuations), len(prompt)
    width = max(len(c) for c in continuations)
    x_prompt = decoder.embed(torch.tensor([prompt], dtype=torch.long, device=device))  # (1, P, C)
    x = decoder.embed(
        torch.tensor([c + [0] * (width - len(c)) for c in continuations], dtype=torch.long, device=device).reshape(
            b, width
        )
    )  # long even when W = 0  # (B, W, C)
    cos, sin = decoder.rope_cos[: p + width].to(x.dtype), decoder.rope_sin[: p + width].to(x.dtype)
    mask = continuation_mask(p, width, device)
    for layer in decoder.layers:
        gqa = layer.n_kv != layer.n_head
        q, k, v = layer.qkv(x_prompt, cos[:p], sin[:p])  # (1, nh, P, hd), (1, nkv, P, hd) x 2
        x_prompt = layer.finish(x_prompt, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa))
        if width:
            q_c, k_c, v_c = layer.qkv(x, cos[p:], sin[p:])
            keys, values = (
                torch.cat([k.expand(b, -1, -1, -1), k_c], dim=2),
                torch.cat([v.expand(b, -1, -1, -1), v_c], dim=2),
            )
            x = layer.finish(x, F.scaled_dot_product_attention(q_c, keys, values, attn_mask=mask, enable_gqa=gqa))
    return decoder.logits(torch.cat([x_prompt[:, -1:].expand(b, 1, -1), x], dim=1))


def runtime_prompt_logits(runtime, prompt: list[int], continuations: list[list[int]]) -> torch.Tensor:  # (B, 1 + W, V)
    """What :func:`shared_prompt_logits` computes, on a runtime that owns its cache (llama.cpp's): the prompt fed
    once to slot 0 and shared with the other slots, each continuation fed to its own slot in one call. The slots are
    emptied afterwards."""
    b, width, p = len(continuations), max(map(len, continuations), default=0), len(prompt)
    last = runtime.forward([(0, prompt)], [1])[0][-1]  # (V,)
    for slot in range(1, b):
        runtime.copy_prefix(0, slot, p)
    out = last.new_zeros((b, 1 + width, last.shape[-1]))
    out[:, 0] = last
    rows = [(slot, c) for slot, c in enumerate(continuations) if c]
    for (slot, c), logits in zip(rows, runtime.forward(rows) if rows else []):
        out[slot, 1 : 1 + len(c)] = logits
    for slot in range(b):
        runtime.rollback(slot, 0)
    return out


def _scorer(target, batch: int, max_len: int):
    """The function giving (B, 1 + W, V) logits of a prompt's continuations: a cache-free torch forward for a lean
    target, else the target's own runtime (llama.cpp, ONNX Runtime) with ``batch`` slots."""
    if hasattr(target, "decoder"):
        return lambda prompt, continuations: shared_prompt_logits(target.decoder, prompt, continuations)
    runtime = target.batched(batch, max_len)  # the target's own runtime: llama.cpp's or ONNX Runtime's
    return lambda prompt, continuations: runtime_prompt_logits(runtime, prompt, continuations)


def score_runs(pair: LoadedPair, runs: list[dict], params: SamplingParams, seed: int, batch: int = 32) -> dict:
    """PIT values of every generated token in each order (:data:`ORDERS`; NaN where the order does not apply) under
    the target's processed distribution given its own prefix, from a plain cache-free forward of the sequences of
    each prompt (:func:`shared_prompt_logits`, or :func:`runtime_prompt_logits` on llama.cpp; up to ``batch`` at a
    time).

    A run is ``{"prompt": ids, "tokens": ids}``, with ``"positions"``, ``"kinds"`` (round positions and token kinds)
    and ``"q"`` (the recorded draft distributions) where the sampler is white-box."""
    generator = torch.Generator().manual_seed(seed)
    vocab = pair.target.vocab_size
    logits_of = _scorer(pair.target, batch, max((len(r["prompt"]) + len(r["tokens"]) for r in runs), default=1))
    values, positions, kinds, heads, seen = {order: [] for order in ORDERS}, [], [], [], set()
    # Only a prefix that enough runs share is tested (run_tests), so only its distribution is kept: at 10^5 tokens
    # keeping every new prefix's (V,) row held gigabytes.
    tested = {
        key
        for key, count in Counter(key for run in runs for key in _prefix_keys(run)).items()
        if count >= MIN_PREFIX_COUNT
    }
    by_prompt: dict[tuple[int, ...], list[dict]] = {}
    for run in runs:
        if run["tokens"]:
            by_prompt.setdefault(tuple(run["prompt"]), []).append(run)
    chunks = [group[i : i + batch] for group in by_prompt.values() for i in range(0, len(group), batch)]
    for chunk in chunks:
        _return_freed_memory()
        with torch.inference_mode():
            logits = logits_of(chunk[0]["prompt"], [run["tokens"][:-1] for run in chunk])[..., :vocab].float().cpu()
        for row, run in zip(logits, chunk):
            prompt, tokens = run["prompt"], run["tokens"]
            probs = block_probs(row[: len(tokens)], prompt, tokens, len(prompt), params)
            uniforms = torch.rand((len(tokens),), dtype=torch.float64, generator=generator)
            for order, pit in _order_pits(
                probs, prompt, tokens, run.get("q") or [None] * len(tokens), uniforms
            ).items():
                values[order].append(pit.numpy())
            positions.append(run.get("positions") or [-1] * len(tokens))
            kinds.append(run.get("kinds") or ["unknown"] * len(tokens))
            first_seen = []  # the distribution after each of its first prefixes, kept where the prefix is tested
            for depth, key in enumerate(_prefix_keys(run)):  # and no earlier run had it
                first_seen.append(probs[depth].clone() if key in tested and key not in seen else None)
                seen.add(key)
            heads.append((tuple(prompt), tuple(tokens[: PREFIX_DEPTH + 1]), first_seen))
    joined = lambda parts: np.concatenate(parts) if parts else np.empty(0)  # noqa: E731 - no run produced a token
    return {
        "pit": {order: joined(v) for order, v in values.items()},
        "position": joined(positions),
        "kind": joined(kinds),
        "heads": heads,
    }


def _return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere). Between
    scoring chunks, glibc otherwise keeps the freed pages of their large transient arrays: at 10^5 tokens
    after a 128-sequence sampling run, resident memory grew past 24 GB."""
    if hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc (macOS, Windows, musl): nothing to trim
    _LIBC = None


def _prefix_keys(run: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, the first ``depth`` generated tokens) for each depth whose next token the run generated, up to
    :data:`PREFIX_DEPTH`: the prefixes whose next-token law run_tests checks."""
    prompt, tokens = tuple(run["prompt"]), run["tokens"]
    return [(prompt, tuple(tokens[:depth])) for depth in range(min(len(tokens), PREFIX_DEPTH + 1))]


def run_tests(name: str, scored: dict, gamma: int) -> list[TestResult]:
    """PIT uniformity in each order, of all tokens and per round position (where known), and next-token goodness
    of fit after repeated prefixes, one test per prefix depth (depth 0: the first token, from the prefill; deeper:
    speculative rounds)."""
    tests, position = [], scored["position"]
    for order, pit in scored["pit"].items():
        present = ~np.isnan(pit)
        subsets = [("all tokens", present)] + [
            (f"round position {k}", present & (position == k)) for k in range(gamma + 1)
        ]
        for subset, chosen in subsets:
            if chosen.sum() >= MIN_TEST_TOKENS:
                tests.append(ks_uniform(f"{name}: {subset}, {order} order, KS", pit[chosen]))
                tests.append(binned_uniform(f"{name}: {subset}, {order} order, tail bins", pit[chosen]))
    for depth in range(PREFIX_DEPTH + 1):
        groups: dict[tuple, tuple[dict, torch.Tensor]] = {}
        for prompt, tokens, probs in scored["heads"]:
            if len(tokens) > depth:  # the first run with a prefix holds its distribution (score_runs)
                counts, _ = groups.setdefault((prompt, tokens[:depth]), ({}, probs[depth]))
                counts[tokens[depth]] = counts.get(tokens[depth], 0) + 1
        repeated = [group for group in groups.values() if sum(group[0].values()) >= MIN_PREFIX_COUNT]
        if repeated:
            tests.append(
                token_goodness_of_fit(
                    f"{name}: next token after a repeated {depth}-token prefix ({len(repeated)} prefixes)", repeated
                )
            )
    return tests


def _greedy_check(pair: LoadedPair, prompts: list[list[int]], config: CertifyConfig) -> dict:
    """Speculative greedy against plain greedy, token for token."""
    plain, speculative = (
        SpeculativeDecoder(pair.target, None, GREEDY),
        SpeculativeDecoder(pair.target, pair.proposer(), GREEDY),
    )
    options = dict(max_new_tokens=config.max_tokens, gamma=config.gamma)
    equal = sum(plain.generate(p, **options).tokens == speculative.generate(p, **options).tokens for p in prompts)
    return {"prompts": len(prompts), "equal": equal}


def _numerics(pair: LoadedPair, prompts: list[list[int]], gamma: int) -> float:
    """Largest |logit| difference between a position computed alone (one token per call) and inside a block."""
    worst = 0.0
    for prompt in prompts:
        context, block = prompt[: -gamma - 1], prompt[-gamma - 1 :]
        if not context:
            continue
        pair.target.prefill(context)
        together = pair.target.forward(block)
        pair.target.prefill(context)
        alone = torch.cat([pair.target.forward([token]) for token in block])
        worst = max(worst, float((together - alone).abs().max()))
    return worst


def default_prompts(tokenizer: TextTokenizer, count: int = 8) -> list[list[int]]:
    """Chat questions in the model's template where it has one (an instruct model), else code openings."""
    if tokenizer.chat_template:
        turns = [t for workload in CHAT_WORKLOADS.values() for t in workload][:count]
        return [tokenizer.encode_chat(chat_messages(turn)) for turn in turns]
    return [tokenizer.encode_prompt(text) for text in workload_prompts("code", count, lines=4)]


def precision_mode(pair: LoadedPair) -> str:
    """The target's numerics, as the certificate names them: dtype, and whether call-size invariant."""
    target = pair.target
    if not hasattr(target, "dtype"):  # llama.cpp: the file's own precision
        return f"{getattr(target, 'precision', 'unknown')}, call-size dependent"
    dtype = str(target.dtype).removeprefix("torch.")
    return f"{dtype}, {'call-size invariant' if target.invariant else 'call-size dependent'}"


def drafting(pair: LoadedPair) -> str:
    """How the pair drafts: ``"draft model"``, ``"feature draft"`` (a trained feature-level draft) or ``"lookup"``."""
    from exactspec.models.eagle import FeatureDraft

    return (
        "lookup" if pair.draft is None else "feature draft" if isinstance(pair.draft, FeatureDraft) else "draft model"
    )


def merge_scored(parts: list[dict]) -> dict:
    """Scored shards (from :func:`score_runs`, in sequence order) as one."""
    return {
        "pit": {order: np.concatenate([p["pit"][order] for p in parts]) for order in ORDERS},
        "position": np.concatenate([p["position"] for p in parts]),
        "kind": np.concatenate([p["kind"] for p in parts]),
        "heads": [head for p in parts for head in p["heads"]],
        "draws": {key: sum(p["draws"][key] for p in parts) for key in ("replayed", "mismatched")},
    }


class LocalSampler:
    """Samples and scores shards of a configuration's sequences here, one engine per (mutant) engine class."""

    def __init__(
        self, pair: LoadedPair, prompts: list[list[int]], config: CertifyConfig, progress: tqdm | None = None
    ) -> None:
        self.pair, self.prompts, self.config, self.progress = pair, prompts, config, progress or tqdm(disable=True)
        self.engine: tuple[str | None, BatchEngine] | None = None  # the last one (caches for all slots): one at a time
        self.max_len = max(len(p) for p in prompts) + config.max_tokens

    def __call__(
        self, config_name: str, mutant: str | None, seed: int, score_seed: int, indices: range | None = None
    ) -> dict:
        """Scored runs of sequences ``indices`` (default: all) of ``config_name``, sampled by the real engine or by
        ``mutant``, with the engine's draw replay counts (``"draws"``); a RuntimeError when a sequence fails (a
        verifier guard tripped)."""
        if self.engine is None or self.engine[0] != mutant:
            self.engine = None  # freed before the next one is built
            self.engine = (
                mutant,
                _recording_engine(self.pair, self.config, self.max_len, MUTANTS[mutant] if mutant else BatchEngine),
            )
        params = CONFIGS[config_name]
        runs = _sample(self.engine[1], self.prompts, params, self.config, seed, self.progress, indices)
        return {**score_runs(self.pair, runs, params, score_seed), "draws": dict(self.engine[1].draws)}


def certify(
    pair: LoadedPair, prompts: list[list[int]], config: CertifyConfig, progress: bool = True, sampler=None
) -> dict:
    """Sample, score and test every configuration (module docstring); with ``config.self_check``, the mutants too.
    ``sampler`` (default: a :class:`LocalSampler`) makes the scored samples, e.g. on Ray
    (:class:`exactspec.jobs.distributed.RaySampler`). The report keeps every configuration's PIT values (token id
    order) under ``per_config[name]["pit"]``."""
    started = time.perf_counter()
    total = (
        config.sequences * config.max_tokens * (len(config.configs) + (len(config.mutants) if config.self_check else 0))
    )
    bar = tqdm(total=total, desc="certify", unit="tok", disable=not progress)
    sampler = sampler or LocalSampler(pair, prompts, config, bar)
    tests, per_config = [], {}
    for index, name in enumerate(config.configs):
        scored = sampler(name, None, config.seed + 10**6 * index, config.seed + index)
        tests += run_tests(name, scored, config.gamma)
        per_config[name] = {
            "tokens": int(len(scored["position"])),
            "pit": scored["pit"]["token id"].tolist(),
            "acceptance_by_position": _acceptance(scored, config.gamma),
            "draws": scored["draws"],
        }
    if not tests:
        raise ValueError(
            f"no configuration produced the {MIN_TEST_TOKENS} tokens "
            "a test needs (sequences ended early); raise --sequences"
        )
    tests = holm(tests, config.alpha)
    sampled_tokens = sum(c["tokens"] for c in per_config.values())
    draws = {key: sum(c["draws"][key] for c in per_config.values()) for key in ("replayed", "mismatched")}
    report = {
        "config": asdict(config),
        "tokens": sampled_tokens,
        "precision": precision_mode(pair),
        "passed": not any(t.rejected for t in tests) and not draws["mismatched"],
        "draws": draws,
        "tests": [asdict(t) for t in tests],
        "detectable_tv": ks_critical_value(min(c["tokens"] for c in per_config.values()), config.alpha / len(tests)),
        "greedy": _greedy_check(pair, prompts[:4], config),
        "numerics_max_logit_difference": _numerics(pair, prompts[:4], config.gamma),
        "per_config": per_config,
    }
    if config.self_check:
        report["self_check"] = _self_check(drafting(pair), sampler, config)
    bar.close()
    report["seconds"] = time.perf_counter() - started
    return report


def _acceptance(scored: dict, gamma: int) -> list[float]:
    """P(draft position k accepted | reached), from the tokens' round positions and kinds."""
    position, drafted = scored["position"], scored["kind"] == "draft"
    rates = []
    for k in range(gamma):
        reached = int(((position == k) & (scored["kind"] != "plain")).sum())
        rates.append(float((drafted & (position == k)).sum()) / reached if reached else 0.0)
    return rates


def _self_check(kind: str, sampler, config: CertifyConfig) -> dict:
    """Each known-wrong engine on its configuration, tested as above (Holm within its own family)."""
    out = {}
    for index, name in enumerate(config.mutants):
        engine_class, config_name = MUTANTS[name], MUTANT_CONFIG[name]
        if not applies(engine_class, kind):
            out[name] = {
                "config": config_name,
                "applies": False,
                "rejected": None,
                "smallest_adjusted_p": None,
                "by": f"not applicable: this pair has no {engine_class.needs}",
                "largest_ks_distance": None,
            }
            continue
        try:
            scored = sampler(config_name, name, config.seed + 10**7 * (index + 1), config.seed)
        except RuntimeError as error:  # a verifier guard caught it before any statistics (a token q says is impossible)
            out[name] = {
                "config": config_name,
                "applies": True,
                "rejected": True,
                "smallest_adjusted_p": 0.0,
                "by": str(error),
                "largest_ks_distance": None,
            }
            continue
        tests = holm(run_tests(config_name, scored, config.gamma), config.alpha)
        worst = min(tests, key=lambda t: t.adjusted_p)
        ks = max(t.statistic for t in tests if t.name.endswith("KS"))
        draws = scored["draws"]
        if draws["mismatched"]:  # a proof, not a p-value: the verifier was handed another q than the draft drew from
            out[name] = {
                "config": config_name,
                "applies": True,
                "rejected": True,
                "smallest_adjusted_p": 0.0,
                "largest_ks_distance": ks,
                "by": (
                    f"draw replay: {draws['mismatched']} of {draws['replayed']} "
                    "draft tokens are not the reported q's draw"
                ),
                "tests_adjusted_p": worst.adjusted_p,
            }
            continue
        out[name] = {
            "config": config_name,
            "applies": True,
            "rejected": any(t.rejected for t in tests),
            "smallest_adjusted_p": worst.adjusted_p,
            "by": worst.name,
            "largest_ks_distance": ks,
        }
    return out
