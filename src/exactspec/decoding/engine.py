"""The decoding loop: a round over a batch of slots, where one generation is a batch of one.

Sequences join a running batch as slots free up and leave when they finish or are cancelled. One
:meth:`BatchEngine.step` (Leviathan et al. 2023, Algorithm 1, for every sequence at once):

1. admits waiting sequences: each prompt is prefilled into its slot and each sequence's first token drawn. A prompt
   several of them share (a request's n choices) is prefilled once and copied; the longest opening of a prompt
   that a running sequence's cache holds (a shared system prompt, another choice of the same request) is copied
   from that cache, and only the rest is fed: in step 4's call when it is at most gamma + 1 tokens;
2. chooses each sequence's gamma (fixed, or from the gamma policy for the source its context routes to);
3. drafts: one :meth:`exactspec.proposers.Proposer.propose` call per proposer for all its drafting sequences (a
   draft model, a trained feature-level draft fed the target's features from step 4 of earlier rounds, prompt
   lookup, or lookup where the context repeats and the draft elsewhere);
4. verifies every sequence's block ``[last committed token] + draft`` in one call of the target runtime
   (:mod:`exactspec.models.runtime`);
5. per sequence: p from the same pipeline as q (:func:`exactspec.decoding.sampling.block_probs`), the rule that fits its
   proposal and its request (:func:`verify_block`: greedy, token-wise for point masses, the block rule of
   :mod:`exactspec.decoding.block` or token-wise for sampled drafts), its own accepted length, its own cache rollback
   (the cache then holds every committed token but the newest, fed at the start of the next round), its tokens handed to
   its listener.

Plain autoregressive decoding is the same round with gamma = 0: the verifier samples the bonus token from p.

Random numbers: each sequence has its own ``torch.Generator`` (seeded by its request). The first token consumes
one uniform; per round the draft's draws come first (one per sampled draft token), then the verifier's
(:mod:`exactspec.decoding.verify`). So a sequence's law does not depend on its neighbours, and a seeded sequence whose
gamma does not depend on the batch (speculation off, or a fixed gamma) draws the same tokens alone as among any
others, up to the low-order bits of batched matrix kernels (:mod:`exactspec.models.lean`).

The three rules of a round (``_draft_probs``, ``_target_probs``, ``_verify_rule``) are methods so that the
certification's self-check can swap in known-wrong ones (:mod:`exactspec.certification.mutants`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from exactspec.decoding.block import RULES, check_rule, expected_accepted, verify_block_rule
from exactspec.decoding.policy import AdaptiveConfig, AdaptiveGamma
from exactspec.decoding.sampling import SamplingParams, block_probs
from exactspec.decoding.stats import GenerationStats, RoundRecord
from exactspec.decoding.verify import VerifyResult, verify_greedy, verify_point_mass, verify_stochastic
from exactspec.models.base import LanguageModel, check_token_ids
from exactspec.models.runtime import Runtime, as_runtime
from exactspec.proposers.base import Draft, DraftRequest, Proposer, common_prefix, processed_q
from exactspec.proposers.prompt_lookup import PromptLookupProposer

__all__ = [
    "BatchEngine",
    "EngineConfig",
    "SequenceRequest",
    "SequenceHandle",
    "SPECULATION_MODES",
    "TokenEvent",
    "verify_block",
]

SPECULATION_MODES = ("off", "draft", "lookup", "auto")
IMPOSSIBLE_LOGPROB = -9999.0


def verify_block(
    params: SamplingParams,
    draft_tokens: torch.Tensor,  # (1, g) int64
    draft_probs: torch.Tensor | None,  # (1, g, V) or None for point-mass proposals
    target_probs: torch.Tensor,  # (1, g + 1, V)
    generator: torch.Generator,
    rule: str = "block",
) -> VerifyResult:
    """The rule that fits the proposal: greedy; for sampled drafts the block rule
    (:mod:`exactspec.decoding.block`) or token-wise min(1, p/q) as ``rule`` says; token-wise for point masses
    (deterministic drafts), where it already accepts a prefix with the target's own probability of it, so the
    block rule has nothing to gain."""
    if params.greedy:
        return verify_greedy(draft_tokens, target_probs)
    if draft_probs is None:
        return verify_point_mass(draft_tokens, target_probs, generator)
    if rule == "block":
        return verify_block_rule(draft_tokens, draft_probs, target_probs, generator)
    return verify_stochastic(draft_tokens, draft_probs, target_probs, generator)


def rule_that_runs(params: SamplingParams, sampled_draft: bool, rule: str) -> str:
    """The verification rule a round runs: "greedy", "token" (point masses, or asked) or "block"."""
    return "greedy" if params.greedy else rule if sampled_draft else "token"


@dataclass(frozen=True, kw_only=True)
class SequenceRequest:
    """The one request type: what every entry point (the decoder, the Speculator, serve, batch jobs, certify,
    the benches) submits to the engine. Its fields are validated here, once, where a request is made."""

    prompt: tuple[int, ...]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS and other stops; the stop token is kept
    seed: int | None = None  # of the sequence's own torch.Generator, in [0, 2^64 - 1]; None: a random seed
    speculation: str = "auto"  # "off", "lookup", "draft" (the engine's proposer) or "auto" (it, else lookup)
    top_logprobs: int | None = None  # None: no log-probabilities; k >= 0: the token's and the k most likely
    gamma: int | str | None = None  # an int: fixed (0: plain); "auto": the gamma policy's; None: see EngineConfig.gamma
    verify: str = "block"  # sampled drafts: "block" (exactspec.decoding.block) or "token" (token-wise min(1, p/q))
    compare_rules: bool = False  # record both rules' E[accepted | draft] of each sampled round (a pass over p and q)

    def __post_init__(self) -> None:
        check_rule(self.verify)
        if not self.prompt:
            raise ValueError("the prompt needs at least one token")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (self.gamma is None or self.gamma == "auto" or (_is_int(self.gamma) and self.gamma >= 0)):
            raise ValueError(f"gamma must be an integer >= 0, 'auto' or None, got {self.gamma!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2^64 - 1] (torch.Generator's range), got {self.seed!r}")
        if self.top_logprobs is not None and not (_is_int(self.top_logprobs) and self.top_logprobs >= 0):
            raise ValueError(f"top_logprobs must be None or an integer >= 0, got {self.top_logprobs!r}")
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: float | None = None  # log p of the token under the target's processed distribution
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there and their log p
    round_position: int = 0  # its index among the tokens its round committed
    kind: str = "plain"  # "draft" (an accepted draft token), "replacement", "bonus" or "plain" (a round without draft)


@dataclass
class SequenceHandle:
    """What a caller holds: its request, a cancel switch, and (when done) the finish reason and figures."""

    request: SequenceRequest
    on_tokens: Callable[[list[TokenEvent]], None]
    on_finish: Callable[[SequenceHandle], None]
    finish_reason: str | None = None  # "stop" (a stop token), "length", "cancelled" or "error"
    error: str | None = None
    exception: BaseException | None = None  # what ended it with "error"
    generated: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)  # one record per target call it took part in
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def drafted(self) -> int:
        return self.stats.drafted

    @property
    def accepted(self) -> int:
        return self.stats.accepted

    @property
    def target_calls(self) -> int:
        return len(self.stats.rounds)

    def figures(self) -> dict:
        return {
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "target_calls": self.target_calls,
            "acceptance_rate": self.stats.acceptance_rate,
            "tokens_per_target_call": self.generated / self.target_calls if self.target_calls else 0.0,
        }


@dataclass(eq=False)  # compared by identity: a sequence is its slot's occupant, not its fields' values
class _Sequence:
    handle: SequenceHandle
    slot: int
    context: list[int]
    generator: torch.Generator
    proposer: Proposer | None  # None: speculation off
    gamma: int | None  # fixed gamma; None: the gamma policy's each step
    source: str = "off"  # this step's proposal source (the proposer's route)

    @property
    def request(self) -> SequenceRequest:
        return self.handle.request


@dataclass(frozen=True)
class EngineConfig:
    gamma: int = 4  # the gamma of a request that names none (gamma=None), unless its speculation is "auto" and unseeded
    max_gamma: int = 8  # the largest gamma of the default policy
    lookup_ngram: tuple[int, int] = (1, 4)

    def __post_init__(self) -> None:
        if self.gamma < 0 or self.max_gamma < 1:
            raise ValueError(f"need gamma >= 0 and max_gamma >= 1, got {self.gamma} and {self.max_gamma}")


@dataclass
class EngineMetrics:
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    sequence_rounds: int = 0  # target calls summed over sequences (a batched call counts once per sequence)
    speculation_on: int = 0  # steps whose auto sequences drafted
    speculation_off: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Round:
    """One sequence's share of a step: its draft and what the step's calls cost."""

    draft: Draft
    draft_seconds: float = 0.0  # of its proposer's call (shared by the sequences drafting in it)
    target_seconds: float = 0.0  # of the verification call (shared by the whole batch)


class BatchEngine:
    def __init__(
        self,
        target: Runtime | LanguageModel,
        proposer: Proposer | None = None,
        config: EngineConfig = EngineConfig(),
        policy: AdaptiveGamma | None = None,
    ) -> None:
        """``target``: a :class:`exactspec.models.runtime.Runtime` (or one model, as one slot). ``proposer``: what
        "draft" and "auto" sequences draft with (None: prompt lookup only), with a slot for every target slot."""
        target = as_runtime(target)
        if proposer is not None:
            slots = getattr(proposer, "slots", None)
            if slots is not None and slots < target.slots:
                raise ValueError(
                    f"the proposer has {slots} slots for the target's {target.slots}: it needs one per target slot"
                )
            if getattr(proposer, "vocab_size", target.vocab_size) != target.vocab_size:
                raise ValueError(
                    f"the proposer's vocabulary ({proposer.vocab_size} "
                    f"tokens) differs from the target's ({target.vocab_size})"
                )
            if proposer.feature_layers:
                target.capture_features(proposer.feature_layers)
        self.target, self.proposer, self.config = target, proposer, config
        self.lookup = PromptLookupProposer(*config.lookup_ngram)
        self.policy = policy or AdaptiveGamma(AdaptiveConfig.up_to(config.max_gamma))
        self.metrics = EngineMetrics()
        self._waiting: collections.deque[SequenceHandle] = collections.deque()
        self._active: list[_Sequence] = []
        self._free = list(range(target.slots))
        self._joining: list[
            tuple[list[_Sequence], list[int]]
        ] = []  # admitted sequences of one prompt, the tokens to feed
        self._lock = threading.Condition()

    # -- the caller's side (any thread) ---------------------------------------------------
    def submit(
        self, request: SequenceRequest, on_tokens, on_finish, stats: GenerationStats | None = None
    ) -> SequenceHandle:
        """Queue ``request``; ``on_tokens`` gets its committed :class:`TokenEvent` s, ``on_finish`` its handle when it
        ends. Its round records go to ``stats`` (a new one when None), the handle's ``stats``."""
        limit = self.target.max_len
        if len(request.prompt) + request.max_new_tokens - 1 > limit:  # the last token drawn is never fed
            raise ValueError(
                f"prompt ({len(request.prompt)} tokens) + max_new_tokens "
                f"{request.max_new_tokens} exceeds the {limit}-position window"
            )
        check_token_ids(request.prompt, self.target.vocab_size)
        handle = SequenceHandle(request, on_tokens, on_finish, stats=stats if stats is not None else GenerationStats())
        with self._lock:
            self._waiting.append(handle)
            self._lock.notify()
        return handle

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self._active)

    def run(self, stop: threading.Event) -> None:
        """Step while there is work, sleep while there is none, until ``stop`` is set; then cancel what is left."""
        while not stop.is_set():
            with self._lock:
                if not self._waiting and not self._active:
                    self._lock.wait(timeout=0.05)
                    continue
            self.step()
        for sequence in list(self._active):
            self._finish(sequence, "cancelled")
        while self._waiting:
            handle = self._waiting.popleft()
            handle.finish_reason = "cancelled"
            handle.on_finish(handle)

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> None:
        for sequence in [s for s in self._active if s.handle.cancelled.is_set()]:
            self._finish(sequence, "cancelled")
        self._admit()
        if not self._active:
            return
        self.metrics.steps += 1
        joining = {s for group, _ in self._joining for s in group}
        ready = [s for s in self._active if s not in joining]
        self._verify(ready, self._draft(ready, self._gammas(ready)))

    def _admit(self) -> None:
        """Take waiting sequences into free slots and prefill them: short prompts together in one call, a prompt
        several of them share once (copied into the others' slots), after what a running sequence already holds
        (:meth:`_reuse_prefix`); a rest of at most gamma + 1 tokens is left to this step's verification call."""
        admitted = []
        while self._free:
            with self._lock:
                if not self._waiting:
                    break
                handle = self._waiting.popleft()
            if handle.cancelled.is_set():
                handle.finish_reason = "cancelled"
                handle.on_finish(handle)
                continue
            sequence = self._new_sequence(handle, self._free.pop(0))
            self._active.append(sequence)
            admitted.append(sequence)
        by_prompt: dict[tuple, list[_Sequence]] = {}  # the sequences of one prompt and proposer: the first prefills it
        for s in admitted:
            by_prompt.setdefault((tuple(s.context), id(s.proposer)), []).append(s)
        donors = [s for s in self._active if s not in admitted]
        groups = [(group, group[0].context[self._reuse_prefix(group[0], donors) :]) for group in by_prompt.values()]
        self._joining = [(group, feed) for group, feed in groups if len(feed) <= 1 + self.config.gamma]  # see _verify
        longest = self.target.max_batched_row
        short = [(group, feed) for group, feed in groups if 1 + self.config.gamma < len(feed) <= longest]
        for call in [short] * bool(short) + [[(group, feed)] for group, feed in groups if len(feed) > longest]:
            began = time.perf_counter()
            logits = self._guarded(
                [s for group, _ in call for s in group],
                self.target.forward,
                [(group[0].slot, feed) for group, feed in call],
                [1] * len(call),
            )  # only the last position's logits: they draw the first token
            seconds = time.perf_counter() - began
            for i, ((group, feed), rows) in enumerate(zip(call, logits or [])):
                self._joined(group, feed, i, rows, seconds)

    def _new_sequence(self, handle: SequenceHandle, slot: int) -> _Sequence:
        """Its proposer (the lookup for "lookup", and for "draft"/"auto" without a proposer) and its gamma rule."""
        request = handle.request
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, (1,)))
        mode = request.speculation
        proposer = None if mode == "off" else self.lookup if mode == "lookup" else self.proposer or self.lookup
        gamma = request.gamma
        if gamma is None:  # a seeded sequence's gamma never depends on the batch
            gamma = "auto" if mode == "auto" and request.seed is None else self.config.gamma
        if proposer is not None:
            proposer.start(slot, request.prompt)
        return _Sequence(
            handle,
            slot,
            list(request.prompt),
            torch.Generator().manual_seed(seed),
            proposer,
            0 if proposer is None else None if gamma == "auto" else gamma,
        )

    def _joined(self, group: list[_Sequence], feed: list[int], row: int, logits: torch.Tensor, seconds: float) -> None:
        """After the call that fed the rest of the first sequence's prompt (row ``row``, its last position's logits
        ``(1, V)``): the others of the group copy its cache, and each draws its first token."""
        first = group[0]
        for s in group:
            if s is not first:
                self.target.copy_prefix(first.slot, s.slot, len(s.context))
                if s.proposer is not None:
                    s.proposer.copy_prefix(first.slot, s.slot, len(s.context) - len(feed))
            self._share_features(s, row, len(feed))
            self._guarded([s], self._first_token, s, logits[-1:], seconds)

    def _reuse_prefix(self, s: _Sequence, donors: list[_Sequence]) -> int:
        """Copy into ``s``'s slot the longest leading part of its prompt that an active sequence's target cache
        holds and its proposer can go on from (:meth:`exactspec.proposers.Proposer.reusable`); keep at least the
        prompt's last token to feed, whose logits draw the first token. Returns the positions copied."""
        best, donor = 0, None
        for other in donors:
            shared = common_prefix(other.context[: self.target.lengths[other.slot]], s.context[:-1])
            if s.proposer is not None:
                shared = s.proposer.reusable(other.slot if other.proposer is s.proposer else None, shared)
            if shared > best:
                best, donor = shared, other
        if donor is None:
            self.target.rollback(s.slot, 0)
            return 0
        self.target.copy_prefix(donor.slot, s.slot, best)
        if s.proposer is not None and donor.proposer is s.proposer:
            s.proposer.copy_prefix(donor.slot, s.slot, best)
        return best

    def _share_features(self, s: _Sequence, row: int, positions: int) -> None:
        """Hand the sequence's proposer the target's features of the first ``positions`` of its row, if it reads
        them."""
        if s.proposer is not None and s.proposer.feature_layers:
            s.proposer.observe(s.slot, self.target.last_features[row][:positions])

    def _first_token(
        self, sequence: _Sequence, logits: torch.Tensor, seconds: float
    ) -> None:  # logits (1, V) after the prompt
        prompt = sequence.context
        p = block_probs(logits, prompt, [], len(prompt), sequence.request.params).unsqueeze(0)  # (1, 1, V)
        result = verify_block(
            sequence.request.params, torch.empty((1, 0), dtype=torch.int64), None, p, sequence.generator
        )
        self._commit(sequence, result.committed(), p[0], RoundRecord(0, 0, 1, 0.0, seconds, 0.0))

    def _gammas(self, sequences: list[_Sequence]) -> dict[int, int]:
        """slot -> gamma of this step, never past a sequence's budget; each sequence's source is set for the step."""
        for s in sequences:
            s.source = "off" if s.proposer is None else s.proposer.route(s.context)
        auto = [s for s in sequences if s.gamma is None]
        auto_gamma = 0
        if auto:
            fixed = [s for s in sequences if s.gamma is not None]
            fixed_rows = sum(1 + s.gamma for s in fixed)
            fixed_tokens = sum(self.policy.expected_tokens(s.source, s.gamma) for s in fixed)
            auto_gamma = self.policy.choose([s.source for s in auto], fixed_rows, fixed_tokens)
            self.metrics.speculation_on += auto_gamma > 0
            self.metrics.speculation_off += auto_gamma == 0
        budget = {s.slot: s.request.max_new_tokens - s.handle.generated - 1 for s in sequences}
        return {s.slot: max(0, min(auto_gamma if s.gamma is None else s.gamma, budget[s.slot])) for s in sequences}

    def _draft(self, sequences: list[_Sequence], gammas: dict[int, int]) -> dict[int, _Round]:
        """slot -> its draft: one :meth:`Proposer.propose` call per proposer for all its drafting sequences."""
        rounds = {s.slot: _Round(Draft([], None)) for s in sequences}
        by_proposer: dict[int, list[_Sequence]] = {}
        for s in sequences:
            if gammas[s.slot] > 0:
                by_proposer.setdefault(id(s.proposer), []).append(s)
        for group in by_proposer.values():
            requests = [
                DraftRequest(s.slot, s.context, len(s.request.prompt), gammas[s.slot], s.request.params, s.generator)
                for s in group
            ]
            began = time.perf_counter()
            drafts = self._guarded(group, self._proposals, group[0].proposer, requests)
            seconds = time.perf_counter() - began
            for s, draft in zip(group, drafts or []):
                rounds[s.slot] = _Round(draft, seconds)
            steps = max((len(d.tokens) for d in drafts or []), default=0)
            if steps and not any(d.setup_seconds for d in drafts):  # a catch-up (a new prompt) is no step cost
                self.policy.observe_draft([s.source for s in group], seconds / steps)
        return rounds

    def _proposals(self, proposer: Proposer, requests: list[DraftRequest]) -> list[Draft]:
        drafts = proposer.propose(requests, self._draft_probs)
        for request, draft in zip(requests, drafts, strict=True):
            if len(draft.tokens) > request.gamma:
                raise ValueError(f"the proposer returned {len(draft.tokens)} tokens for gamma = {request.gamma}")
        return drafts

    # The three rules of a round, as methods so that the certification's self-check can swap in known-wrong ones
    # (exactspec.certification.mutants); nothing else overrides them.
    def _draft_probs(
        self,
        logits: torch.Tensor,
        prefix: list[int],
        prompt_length: int,
        params: SamplingParams,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q to draw the draft token from, q reported to the verifier)``:
        :data:`exactspec.proposers.base.DraftRule`."""
        return processed_q(logits, prefix, prompt_length, params, token_ids)

    def _target_probs(
        self, logits: torch.Tensor, context: list[int], block: list[int], prompt_length: int, params: SamplingParams
    ) -> torch.Tensor:  # (g + 1, V)
        return block_probs(logits, context, block, prompt_length, params)

    def _verify_rule(self, params, draft_tokens, draft_probs, target_probs, generator, rule):
        return verify_block(params, draft_tokens, draft_probs, target_probs, generator, rule)

    def _verify(self, sequences: list[_Sequence], rounds: dict[int, _Round]) -> None:
        """One target call for every sequence's block, and the rest of the prompts of sequences joining with a few
        tokens left to feed (a prompt a running sequence's cache held): a prefill call of its own would read every
        weight again for a row or two, while a few more tokens in this call cost little padding."""
        joining, self._joining = self._joining, []
        sequences = [s for s in sequences if s in self._active]  # not those whose drafting failed
        rows = [(s.slot, [s.context[-1], *rounds[s.slot].draft.tokens]) for s in sequences] + [
            (group[0].slot, feed) for group, feed in joining
        ]
        if not rows:
            return
        started = time.perf_counter()
        outputs = [len(row) for _, row in rows[: len(sequences)]] + [1] * len(joining)
        logits = self._guarded(
            sequences + [s for group, _ in joining for s in group], self.target.forward, rows, outputs
        )
        if logits is None:
            return
        seconds = time.perf_counter() - started
        self.policy.observe_target(sum(len(r[1]) for r in rows), seconds)
        self.metrics.target_calls += 1
        for i, (s, row) in enumerate(zip(sequences, logits)):
            rounds[s.slot].target_seconds = seconds
            self._guarded([s], self._round_end, s, i, row, rounds[s.slot])
        for i, (group, feed) in enumerate(joining, start=len(sequences)):
            self._joined(group, feed, i, logits[i], seconds)

    def _round_end(self, s: _Sequence, row: int, logits: torch.Tensor, round_: _Round) -> None:
        """Verify the sequence's block (logits ``(g + 1, V)``), roll its cache back to the accepted tokens, commit."""
        began = time.perf_counter()
        params, draft = s.request.params, round_.draft
        p = self._target_probs(logits, s.context, draft.tokens, len(s.request.prompt), params)  # (g + 1, V)
        draft_tokens = torch.tensor([draft.tokens], dtype=torch.int64).reshape(1, -1)
        draft_probs = None if draft.probs is None else draft.probs.unsqueeze(0)
        result = self._verify_rule(params, draft_tokens, draft_probs, p.unsqueeze(0), s.generator, s.request.verify)
        accepted = int(result.num_accepted[0])
        self.target.rollback(s.slot, len(s.context) + accepted)
        self._share_features(s, row, accepted + 1)
        verify_seconds = time.perf_counter() - began
        expected = {}
        if s.request.compare_rules and draft_probs is not None and not params.greedy and draft.tokens:
            expected = {
                rule: float(expected_accepted(rule, draft_tokens, draft_probs, p.unsqueeze(0))[0, -1]) for rule in RULES
            }
        record = RoundRecord(
            len(draft.tokens),
            accepted,
            accepted + 1,
            round_.draft_seconds,
            round_.target_seconds,
            verify_seconds,
            draft.setup_seconds,
            rule_that_runs(params, draft_probs is not None, s.request.verify),
            expected.get("block"),
            expected.get("token"),
            s.source,
        )
        self.policy.observe_round(s.source, record)
        self._commit(s, result.committed(), p, record)

    def _commit(self, s: _Sequence, committed: list[int], p: torch.Tensor, record: RoundRecord) -> None:
        """Hand ``committed`` (with log-probabilities from the rows of ``p`` (n, V)) to the listener, stopping at
        a stop token or the budget."""
        handle = s.handle
        handle.stats.observe(record)
        self.metrics.drafted += record.drafted
        self.metrics.accepted += record.accepted
        self.metrics.sequence_rounds += 1
        events, reason = [], None
        for i, token in enumerate(committed):
            kind = (
                "draft"
                if i < record.accepted
                else "plain"
                if record.drafted == 0
                else "bonus"
                if record.accepted == record.drafted
                else "replacement"
            )
            events.append(replace(self._event(token, p[i], s.request.top_logprobs), round_position=i, kind=kind))
            s.context.append(token)
            handle.generated += 1
            if token in s.request.stop_token_ids:
                reason = "stop"
                break
            if handle.generated >= s.request.max_new_tokens:
                reason = "length"
                break
        self.metrics.tokens += len(events)
        handle.on_tokens(events)
        if reason:
            self._finish(s, reason)

    @staticmethod
    def _event(token: int, probs: torch.Tensor, top: int | None) -> TokenEvent:  # probs (V,)
        if top is None:
            return TokenEvent(token)
        logp = torch.where(
            probs > 0, probs.log(), torch.full_like(probs, IMPOSSIBLE_LOGPROB)
        )  # OpenAI's -9999 for p = 0
        best = torch.topk(logp, min(top, logp.shape[0])) if top else None
        alternatives = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
        return TokenEvent(token, float(logp[token]), alternatives)

    def _finish(self, s: _Sequence, reason: str, error: BaseException | None = None) -> None:
        if s not in self._active:
            return
        self._active.remove(s)
        self._free.append(s.slot)
        self._free.sort()
        s.handle.finish_reason = reason
        if error is not None:
            s.handle.error, s.handle.exception = f"{type(error).__name__}: {error}", error
        self.metrics.finished[reason] += 1
        s.handle.on_finish(s.handle)

    def _guarded(self, sequences: list[_Sequence], work, *args):
        """Run ``work``; if it raises, the sequences it served end with an error and the engine goes on."""
        try:
            return work(*args)
        except Exception as error:  # noqa: BLE001 - one request's failure must not stop the others
            for s in sequences:
                self._finish(s, "error", error)
            return None
