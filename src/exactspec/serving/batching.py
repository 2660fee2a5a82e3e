"""Continuous batching with ragged speculative verification.

Sequences join a running batch as slots free up and leave when they finish or are cancelled. One
:meth:`BatchEngine.step`:

1. admits waiting sequences: each prompt is prefilled into its slot and each sequence's first token drawn. A prompt
   several of them share (a request's n choices) is prefilled once and copied; the longest opening of a prompt
   that a running sequence's cache holds (a shared system prompt, another choice of the same request) is copied
   from that cache, and only the rest is fed: in step 4's call when it is at most gamma + 1 tokens;
2. chooses each sequence's gamma (its speculation mode; ``auto`` from the batch policy, :mod:`.policy`);
3. drafts: prompt lookup per sequence, and the draft (a draft model, or a trained feature-level draft fed the
   target's features from step 4 of earlier rounds) for all drafting sequences together, one batched draft call
   per draft position (the first also catches each draft slot up with its context);
4. verifies every sequence's block in one batched target call (:class:`exactspec.models.batched.BatchedLean`);
5. per sequence: the rule that fits its proposal (:func:`exactspec.engine.verify_block`), its own accepted
   length, its own cache rollback, its tokens handed to its listener.

Per sequence this is exactly the round of :class:`exactspec.engine.SpeculativeDecoder`, with the same order of
random draws from the sequence's own generator (the first token: one uniform; per round the draft's, then the
verifier's), so a sequence's law does not depend on its neighbours, and a seeded sequence whose gamma does not
depend on the batch (speculation off, draft or lookup at the fixed gamma) draws the same tokens alone as among
any others, up to the low-order bits of batched matrix kernels (:mod:`exactspec.models.batched`).
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from exactspec.engine import verify_block
from exactspec.models.batched import MAX_BLOCK, BatchedLean
from exactspec.models.batched_feature_draft import BatchedFeatureDraft
from exactspec.proposers.prompt_lookup import find_continuation
from exactspec.sampling import SamplingParams, block_probs, full_width
from exactspec.serving.policy import BatchPolicy
from exactspec.verify import greedy_token, sample_from

__all__ = ["BatchEngine", "EngineConfig", "SequenceRequest", "SequenceHandle", "SPECULATION_MODES", "TokenEvent"]

SPECULATION_MODES = ("off", "draft", "lookup", "auto")
IMPOSSIBLE_LOGPROB = -9999.0


@dataclass(frozen=True)
class SequenceRequest:
    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    seed: int | None = None  # None: a random seed; given: the sequence's gamma never depends on the batch
    speculation: str = "auto"
    top_logprobs: int | None = None  # None: no log-probabilities; k >= 0: the token's and the k most likely

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if self.max_tokens < 1 or not self.prompt:
            raise ValueError("a sequence needs a non-empty prompt and max_tokens >= 1")


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
    on_finish: Callable[["SequenceHandle"], None]
    finish_reason: str | None = None  # "stop" (a stop token), "length", "cancelled" or "error"
    error: str | None = None
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    generated: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def figures(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted, "target_calls": self.target_calls,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_target_call": self.generated / self.target_calls if self.target_calls else 0.0}


@dataclass(eq=False)  # compared by identity: a sequence is its slot's occupant, not its fields' values
class _Sequence:
    handle: SequenceHandle
    slot: int
    context: list[int]
    generator: torch.Generator
    source: str  # "off", "draft" or "lookup": where its drafts come from
    fixed_gamma: bool  # True: the configured gamma; False: the batch policy's
    draft_fed: list[int] = field(default_factory=list)  # a draft model: the tokens in its draft slot
    new_features: list[torch.Tensor] = field(default_factory=list)  # a feature draft: target features not yet fed
    features_known: int = 0  # a feature draft: positions whose target features it was handed
    draft_slots: int = 0  # a feature draft: its slots built from target features
    draft_output: torch.Tensor | None = None  # a feature draft: (1, C) its output at the last slot it fed

    @property
    def request(self) -> SequenceRequest:
        return self.handle.request


@dataclass(frozen=True)
class EngineConfig:
    gamma: int = 4  # fixed gamma of draft and lookup modes (and of seeded auto requests)
    max_gamma: int = 8  # the batch policy's largest gamma
    lookup_ngram: tuple[int, int] = (1, 4)


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


class BatchEngine:
    def __init__(self, target: BatchedLean, draft: BatchedLean | None = None, config: EngineConfig = EngineConfig(),
                 policy: BatchPolicy | None = None, feature_draft: BatchedFeatureDraft | None = None) -> None:
        """``draft``: a draft model, batched like the target. ``feature_draft``: instead, a trained feature-level
        draft that reads the target's features (``target.capture_features`` must be on for its layers)."""
        for model in (draft, feature_draft):
            if model is not None and model.slots < target.slots:
                raise ValueError("the draft needs a slot for every target slot")
        self._draft_ids = None  # the token ids of the draft's logit columns; None: column c is token c
        if feature_draft is not None:
            if draft is not None or tuple(target.feature_layers) != tuple(feature_draft.draft.cfg.feature_layers):
                raise ValueError("a feature-level draft needs the target to capture its layers, and no draft model beside it")
            ids = feature_draft.draft.vocab_ids.cpu()
            self._draft_ids = ids[ids < target.vocab_size]  # its vocabulary S within the target's, ascending
        self.target, self.draft, self.config = target, draft, config
        self.feature_draft = feature_draft
        self.policy = policy or BatchPolicy(max_gamma=config.max_gamma)
        self.metrics = EngineMetrics()
        self._waiting: collections.deque[SequenceHandle] = collections.deque()
        self._active: list[_Sequence] = []
        self._free = list(range(target.slots))
        self._joining: list[tuple[list[_Sequence], list[int]]] = []  # admitted sequences of one prompt, the tokens to feed
        self._lock = threading.Condition()

    # -- the caller's side (any thread) ---------------------------------------------------
    def submit(self, request: SequenceRequest, on_tokens, on_finish) -> SequenceHandle:
        limit = self.target.max_len
        if len(request.prompt) + request.max_tokens > limit:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_tokens {request.max_tokens} exceeds the {limit}-position window")
        handle = SequenceHandle(request, on_tokens, on_finish)
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
        gammas = self._gammas(ready)
        drafts = self._draft(ready, gammas)
        self._verify(ready, drafts)

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
            request = handle.request
            seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, (1,)))
            source = request.speculation
            if source == "auto":
                source = "draft" if self.draft is not None else "lookup"
            if source == "draft" and self.draft is None and self.feature_draft is None:
                source = "lookup"  # a target without a draft: lookup is the draft it has
            sequence = _Sequence(handle, self._free.pop(0), list(request.prompt), torch.Generator().manual_seed(seed),
                                 source, fixed_gamma=request.speculation != "auto" or request.seed is not None)
            self._active.append(sequence)
            admitted.append(sequence)
        by_prompt: dict[tuple, list[_Sequence]] = {}  # the sequences of one prompt and source: the first prefills it
        for s in admitted:
            by_prompt.setdefault((tuple(s.context), s.source), []).append(s)
        donors = [s for s in self._active if s not in admitted]
        groups = [(group, group[0].context[self._reuse_prefix(group[0], donors) :]) for group in by_prompt.values()]
        self._joining = [(group, feed) for group, feed in groups if len(feed) <= 1 + self.config.gamma]  # see _verify
        short = [(group, feed) for group, feed in groups if 1 + self.config.gamma < len(feed) <= MAX_BLOCK]
        for call in [short] * bool(short) + [[(group, feed)] for group, feed in groups if len(feed) > MAX_BLOCK]:
            logits = self._guarded([s for group, _ in call for s in group], self.target.forward, [(group[0].slot, feed) for group, feed in call])
            for i, ((group, feed), rows) in enumerate(zip(call, logits or [])):
                self._joined(group, feed, i, rows)

    def _joined(self, group: list[_Sequence], feed: list[int], row: int, logits: torch.Tensor) -> None:
        """After the call that fed the rest of the first sequence's prompt (row ``row``, logits ``(len(feed), V)``):
        the others of the group copy its cache, and each draws its first token."""
        first = group[0]
        for s in group:
            if s is not first:
                self.target.copy_prefix(first.slot, s.slot, len(s.context))
                self._copy_draft_prefix(first, s, len(s.context) - len(feed))
            self._share_features(s, row, len(feed))
            self._guarded([s], self._first_token, s, logits[-1:])

    def _reuse_prefix(self, s: _Sequence, donors: list[_Sequence]) -> int:
        """Copy into ``s``'s slot the longest leading part of its prompt that an active sequence's target cache
        holds (and, for a feature draft, its draft cache: slot j reads token j + 1, so one position fewer); keep at
        least the prompt's last token to feed, whose logits draw the first token. Returns the positions copied."""
        best, donor = 0, None
        feature_drafting = self.feature_draft is not None and s.source == "draft"
        for other in donors:
            shared = _common_prefix(other.context[: self.target.lengths[other.slot]], s.context[:-1])
            if feature_drafting:
                shared = min(shared - 1, other.draft_slots) if other.source == "draft" else 0
            if shared > best:
                best, donor = shared, other
        if donor is None:
            self.target.rollback(s.slot, 0)
            return 0
        self.target.copy_prefix(donor.slot, s.slot, best)
        self._copy_draft_prefix(donor, s, best)
        return best

    def _copy_draft_prefix(self, source: _Sequence, s: _Sequence, length: int) -> None:
        """A feature draft's first ``length`` slots, built from target features the two sequences share."""
        if self.feature_draft is not None and s.source == "draft" and length:
            self.feature_draft.copy_prefix(source.slot, s.slot, length)
            s.draft_slots = s.features_known = length

    def _share_features(self, s: _Sequence, row: int, positions: int) -> None:
        """Keep the target's features of the first ``positions`` of its row for the sequence's feature draft."""
        if self.feature_draft is not None and s.source == "draft":
            s.new_features.append(self.target.last_features[row][:positions])
            s.features_known += positions

    def _first_token(self, sequence: _Sequence, logits: torch.Tensor) -> None:  # logits (1, V) after the prompt
        prompt = sequence.context
        p = block_probs(logits, prompt, [], len(prompt), sequence.request.params).unsqueeze(0)  # (1, 1, V)
        result = verify_block(sequence.request.params, torch.empty((1, 0), dtype=torch.int64), None, p, sequence.generator)
        self._commit(sequence, result.committed(), p[0], accepted=0, drafted=0)

    def _gammas(self, sequences: list[_Sequence]) -> dict[int, int]:
        """slot -> gamma of this step, never past a sequence's budget."""
        auto = [s for s in sequences if not s.fixed_gamma and s.source != "off"]
        fixed = [(s.source, 0 if s.source == "off" else self.config.gamma) for s in sequences if s not in auto]
        fixed_rows = sum(1 + gamma for _, gamma in fixed)
        fixed_tokens = sum(self.policy.expected_tokens(source, gamma) for source, gamma in fixed)
        auto_gamma = self.policy.choose([s.source for s in auto], fixed_rows, fixed_tokens) if auto else 0
        if auto:
            self.metrics.speculation_on += auto_gamma > 0
            self.metrics.speculation_off += auto_gamma == 0
        gammas = {}
        for s in sequences:
            gamma = 0 if s.source == "off" else (self.config.gamma if s.fixed_gamma else auto_gamma)
            gammas[s.slot] = max(0, min(gamma, s.request.max_tokens - s.handle.generated - 1))
        return gammas

    def _draft(self, sequences: list[_Sequence], gammas: dict[int, int]) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """slot -> (draft tokens, their q rows (g, V) or None for point masses)."""
        drafts = {s.slot: ([], None) for s in sequences}
        lo, hi = self.config.lookup_ngram
        for s in sequences:
            if s.source == "lookup" and gammas[s.slot] > 0:
                drafts[s.slot] = (find_continuation(s.context, gammas[s.slot], lo, hi), None)
        drafting = [s for s in sequences if s.source == "draft" and gammas[s.slot] > 0]
        if drafting:
            self._guarded(drafting, self._draft_batched, drafting, gammas, drafts)
        return drafts

    def _draft_batched(self, drafting: list[_Sequence], gammas: dict[int, int], drafts: dict) -> None:
        """The draft tokens of every drafting sequence, one batched draft call per draft position. Each token is
        drawn (greedy: argmax) from q of :meth:`_draft_probs` over the draft's columns; a sequence whose settings
        leave its draft nothing to propose stops drafting there."""
        call = self._feature_draft_call if self.feature_draft is not None else self._draft_model_call
        step_seconds = []  # of steps that feed each row 1 or 2 tokens: a catch-up after plain steps is setup
        prefixes = {s.slot: list(s.context) for s in drafting}
        tokens = {s.slot: [] for s in drafting}
        rows = {s.slot: [] for s in drafting}
        live = drafting
        for step in range(max(gammas[s.slot] for s in drafting)):
            began = time.perf_counter()
            logits, setup = call(step, live, tokens)
            if not setup:
                step_seconds.append(time.perf_counter() - began)
            for s, row in zip(live, logits):
                params = s.request.params
                try:
                    q, reported = self._draft_probs(row, prefixes[s.slot], len(s.request.prompt), params)
                except ValueError:  # every token the draft has is excluded (allowed/banned sets, bias)
                    continue
                if params.greedy:
                    column = greedy_token(q)
                else:
                    column = sample_from(q.unsqueeze(0), torch.rand((1,), dtype=torch.float64, generator=s.generator))[0]
                token = int(column) if self._draft_ids is None else int(self._draft_ids[column])
                tokens[s.slot].append(token)
                rows[s.slot].append(reported)
                prefixes[s.slot].append(token)
            live = [s for s in live if len(tokens[s.slot]) == step + 1 < gammas[s.slot]]
            if not live:
                break
        for s in drafting:
            reported = None if s.request.params.greedy or not rows[s.slot] else torch.stack(rows[s.slot])
            drafts[s.slot] = (tokens[s.slot], None if reported is None else full_width(reported, self._draft_ids, self.target.vocab_size))
        if step_seconds:
            self.policy.observe_draft(len(drafting), statistics.median(step_seconds))

    def _draft_model_call(self, step: int, live: list[_Sequence], tokens: dict) -> tuple[list[torch.Tensor], bool]:
        """The draft model's logits ``(1, V)`` per live sequence after its context and its draft tokens so far, and
        whether the call was setup (a catch-up of more than 2 tokens) rather than a draft step."""
        if step == 0:
            feeds = [(s.slot, self._catch_up(s)) for s in live]
        else:
            feeds = [(s.slot, tokens[s.slot][-1:]) for s in live]
            for s in live:
                s.draft_fed.append(tokens[s.slot][-1])
        return [row[-1:] for row in self._draft_call(feeds)], max(len(feed) for _, feed in feeds) > 2

    def _feature_draft_call(self, step: int, live: list[_Sequence], tokens: dict) -> tuple[list[torch.Tensor], bool]:
        """As :meth:`_draft_model_call` for the feature-level draft (:mod:`exactspec.models.eagle`): the first step
        rolls each slot back to what the target's features built (dropping last round's predicted slots) and feeds
        the features the target computed since; each later step feeds the draft's own output and its last token.
        Logits ``(1, |S|)`` cover the draft's vocabulary S (columns ``self._draft_ids``)."""
        draft = self.feature_draft
        if step == 0:
            rows = []
            for s in live:
                n = len(s.context)
                if s.features_known != n - 1:
                    raise RuntimeError(f"the target's features cover {s.features_known} positions, the context needs {n - 1}")
                draft.rollback(s.slot, s.draft_slots)
                rows.append((s.slot, draft.project(torch.cat(s.new_features)), s.context[s.draft_slots + 1 :]))
                s.new_features, s.draft_slots = [], n - 1
        else:
            rows = [(s.slot, s.draft_output, tokens[s.slot][-1:]) for s in live]
        outputs, subset_logits = draft.forward(rows)
        for s, output in zip(live, outputs):
            s.draft_output = output.unsqueeze(0)
        return list(subset_logits[:, : len(self._draft_ids)].cpu().unsqueeze(1)), max(len(t) for _, _, t in rows) > 2

    # The three rules of a round, as methods so that the certification's self-check can swap in known-wrong ones
    # (exactspec.certification.mutants); nothing else overrides them.
    def _draft_probs(self, logits: torch.Tensor, prefix: list[int], prompt_length: int, params: SamplingParams):
        """``(q to draw the draft token from, q reported to the verifier)`` over the draft's columns each: the same
        distribution, from the same pipeline as the target's p. ``logits`` ``(1, V)`` or, for a feature draft,
        ``(1, |S|)``."""
        q = block_probs(logits, prefix, [], prompt_length, params, token_ids=self._draft_ids)[0]
        return q, q

    def _target_probs(self, logits: torch.Tensor, context: list[int], block: list[int], prompt_length: int,
                      params: SamplingParams) -> torch.Tensor:  # (g + 1, V)
        return block_probs(logits, context, block, prompt_length, params)

    def _verify_rule(self, params, draft_tokens, draft_probs, target_probs, generator):
        return verify_block(params, draft_tokens, draft_probs, target_probs, generator)

    def _catch_up(self, s: _Sequence) -> list[int]:  # the draft model's
        """Roll the draft slot back to what it shares with the context; the tokens it still has to read."""
        keep = _common_prefix(s.draft_fed, s.context[:-1])  # feed at least the newest token
        self.draft.rollback(s.slot, keep)
        s.draft_fed = list(s.context)
        return s.context[keep:]

    def _draft_call(self, rows: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One batched draft call; a catch-up longer than a batched row allows (a prompt) is fed alone first."""
        for slot, feed in rows:
            if len(feed) > MAX_BLOCK:
                self.draft.forward([(slot, feed[:-1])])
        return self.draft.forward([(slot, feed[-1:] if len(feed) > MAX_BLOCK else feed) for slot, feed in rows])

    def _verify(self, sequences: list[_Sequence], drafts: dict[int, tuple[list[int], torch.Tensor | None]]) -> None:
        """One target call for every sequence's block, and the rest of the prompts of sequences joining with a few
        tokens left to feed (a prompt a running sequence's cache held): a prefill call of its own would read every
        weight again for a row or two, while a few more tokens in this call cost little padding."""
        joining, self._joining = self._joining, []
        sequences = [s for s in sequences if s in self._active]  # not those whose drafting failed
        rows = [(s.slot, [s.context[-1], *drafts[s.slot][0]]) for s in sequences] + [(group[0].slot, feed) for group, feed in joining]
        if not rows:
            return
        started = time.perf_counter()
        logits = self._guarded(sequences + [s for group, _ in joining for s in group], self.target.forward, rows)
        if logits is None:
            return
        self.policy.observe_target(sum(len(r[1]) for r in rows), time.perf_counter() - started)
        self.metrics.target_calls += 1
        for i, (s, row) in enumerate(zip(sequences, logits)):
            self._guarded([s], self._round_end, s, i, row, *drafts[s.slot])
        for i, (group, feed) in enumerate(joining, start=len(sequences)):
            self._joined(group, feed, i, logits[i])

    def _round_end(self, s: _Sequence, row: int, logits: torch.Tensor, tokens: list[int], probs: torch.Tensor | None) -> None:
        params = s.request.params
        p = self._target_probs(logits, s.context, tokens, len(s.request.prompt), params)  # (g + 1, V)
        draft_tokens = torch.tensor([tokens], dtype=torch.int64).reshape(1, -1)
        result = self._verify_rule(params, draft_tokens, None if probs is None else probs.unsqueeze(0), p.unsqueeze(0), s.generator)
        accepted = int(result.num_accepted[0])
        self.target.rollback(s.slot, len(s.context) + accepted)
        self._share_features(s, row, accepted + 1)
        if tokens:
            self.policy.observe_round(s.source, len(tokens), accepted)
        self._commit(s, result.committed(), p, accepted, len(tokens))

    def _commit(self, s: _Sequence, committed: list[int], p: torch.Tensor, accepted: int, drafted: int) -> None:
        """Hand ``committed`` (with log-probabilities from the rows of ``p`` (n, V)) to the listener, stopping at
        a stop token or the budget."""
        handle = s.handle
        handle.drafted += drafted
        handle.accepted += accepted
        handle.target_calls += 1
        self.metrics.drafted += drafted
        self.metrics.accepted += accepted
        self.metrics.sequence_rounds += 1
        events, reason = [], None
        for i, token in enumerate(committed):
            kind = "draft" if i < accepted else "plain" if drafted == 0 else "bonus" if accepted == drafted else "replacement"
            events.append(replace(self._event(token, p[i], s.request.top_logprobs), round_position=i, kind=kind))
            s.context.append(token)
            handle.generated += 1
            if token in s.request.stop_token_ids:
                reason = "stop"
                break
            if handle.generated >= s.request.max_tokens:
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
        logp = torch.where(probs > 0, probs.log(), torch.full_like(probs, IMPOSSIBLE_LOGPROB))  # OpenAI's -9999 for p = 0
        best = torch.topk(logp, min(top, logp.shape[0])) if top else None
        alternatives = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
        return TokenEvent(token, float(logp[token]), alternatives)

    def _finish(self, s: _Sequence, reason: str, error: str | None = None) -> None:
        if s not in self._active:
            return
        self._active.remove(s)
        self._free.append(s.slot)
        self._free.sort()
        s.handle.finish_reason, s.handle.error = reason, error
        self.metrics.finished[reason] += 1
        s.handle.on_finish(s.handle)

    def _guarded(self, sequences: list[_Sequence], work, *args):
        """Run ``work``; if it raises, the sequences it served end with an error and the engine goes on."""
        try:
            return work(*args)
        except Exception as error:  # noqa: BLE001 - one request's failure must not stop the others
            message = f"{type(error).__name__}: {error}"
            for s in sequences:
                self._finish(s, "error", message)
            return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def calibrate(engine: BatchEngine, repeats: int = 2) -> None:
    """Give the batch policy call costs before the first request: target calls of 1 and ``max_gamma + 1`` tokens
    per row for one sequence and for a full batch, and draft steps for one and for a full batch (each after an
    untimed warm-up). Leaves every slot empty."""
    def timed(model: BatchedLean, rows: list[tuple[int, list[int]]]) -> float:
        for slot, _ in rows:
            model.rollback(slot, 0)
        model.forward([(slot, [0] * 8) for slot, _ in rows])  # a short history, as in a running batch
        times = []
        for call in range(repeats + 1):
            began = time.perf_counter()
            model.forward(rows)
            if call:
                times.append(time.perf_counter() - began)
            for slot, _ in rows:
                model.rollback(slot, 8)
        return statistics.median(times)

    full = engine.target.slots
    for batch in sorted({1, full}):
        for tokens in (1, engine.config.max_gamma + 1):
            engine.policy.observe_target(batch * tokens, timed(engine.target, [(s, [0] * tokens) for s in range(batch)]))
        if engine.draft is not None:
            engine.policy.observe_draft(batch, timed(engine.draft, [(s, [0]) for s in range(batch)]))
    for model in (engine.target, engine.draft):
        for slot in range(model.slots if model is not None else 0):
            model.rollback(slot, 0)
