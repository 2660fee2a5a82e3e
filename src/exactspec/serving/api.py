"""``exactspec serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (the tokenizer's chat template), ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus text). Streaming uses server-sent events, as OpenAI's. Every response
carries the usual ``usage`` and, per choice, exactspec's speculation figures (``speculation``).

Limits (:class:`ServerSettings`): request body bytes, ``max_tokens``, ``n``, and sequences in flight (queued or
running); past them a request gets a 4xx with an OpenAI-style error body and nothing runs. With an API key every
request but ``/health`` needs ``Authorization: Bearer KEY``.

The engine runs in one background thread (:meth:`exactspec.decoding.engine.BatchEngine.run`); request handlers
hand it sequences and receive tokens through asyncio queues. A client that disconnects mid-stream cancels its
sequences: they leave the batch at the next step and their slots are freed.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from exactspec.decoding.engine import BatchEngine, SequenceHandle, SequenceRequest, TokenEvent
from exactspec.decoding.sampling import SamplingParams
from exactspec.decoding.seeds import sample_seed
from exactspec.serving.protocol import ChatRequest, CompletionRequest
from exactspec.tokenizer import TextTokenizer

__all__ = ["ServerCounters", "ServerSettings", "ServingApp", "create_app"]


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens: int = 1024  # largest max_tokens a request may ask for
    max_n: int = 8
    max_sequences: int = 64  # queued + running sequences; more: 429
    record_base: dict | None = (
        None  # the server's part of a run record (exactspec.jobs.records.run_record), for return_record
    )


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class _Choice:
    """One sequence of a request: its tokens arrive on an asyncio queue; stop strings are applied to its text."""

    def __init__(self, index: int, tokenizer: TextTokenizer, stops: list[str], loop: asyncio.AbstractEventLoop) -> None:
        self.index, self.tokenizer, self.stops, self.loop = index, tokenizer, stops, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tokens: list[int] = []
        self.events: list[TokenEvent] = []
        self.sent = 0  # characters of text already handed out
        self.finish_reason: str | None = None
        self.handle: SequenceHandle | None = None

    # called from the engine thread
    def on_tokens(self, events: list[TokenEvent]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", events))

    def on_finish(self, handle: SequenceHandle) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("finish", handle))

    def add(self, events: list[TokenEvent], stop_ids: frozenset[int]) -> str:
        """Take new tokens; returns the text that is now safe to hand out (a stop string ends it)."""
        self.events += events
        self.tokens += [e.token for e in events]
        text = self.tokenizer.decode([t for t in self.tokens if t not in stop_ids])
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                self.finish_reason = "stop"
                self.handle.cancel()
                piece, self.sent = text[self.sent : at], at
                return piece
        if text.endswith("\ufffd"):
            return ""  # a character cut between tokens
        hold = max((len(s) - 1 for s in self.stops), default=0)  # a stop string may be starting
        safe = max(self.sent, len(text) - hold)
        piece, self.sent = text[self.sent : safe], safe
        return piece

    def rest(self, stop_ids: frozenset[int]) -> str:
        if self.finish_reason == "stop" and self.stops:
            return ""
        text = self.tokenizer.decode([t for t in self.tokens if t not in stop_ids])
        piece, self.sent = text[self.sent :], len(text)
        return piece

    def logprobs(self, chat: bool) -> dict | None:
        if not self.events or self.events[0].logprob is None:
            return None
        text = self.tokenizer.token_text
        if chat:
            return {
                "content": [
                    {
                        "token": text(e.token),
                        "logprob": e.logprob,
                        "top_logprobs": [{"token": text(t), "logprob": lp} for t, lp in e.top],
                    }
                    for e in self.events
                ]
            }
        return {
            "tokens": [text(e.token) for e in self.events],
            "token_logprobs": [e.logprob for e in self.events],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in self.events],
        }


@dataclass
class ServerCounters:
    """What the server counts beside the engine's metrics: sequences in flight, requests taken, requests failed."""

    sequences: int = 0
    requests: int = 0
    errors: int = 0


class ServingApp:
    """The server's handlers as named methods over one engine, tokenizer and settings; :func:`create_app` routes
    them. Each handler can be called (and tested) without HTTP routing; the engine runs in :meth:`lifespan`."""

    def __init__(self, engine: BatchEngine, tokenizer: TextTokenizer, settings: ServerSettings) -> None:
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.counters = ServerCounters()
        self.stop_engine = threading.Event()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        thread = threading.Thread(
            target=self.engine.run, args=(self.stop_engine,), name="exactspec-engine", daemon=True
        )
        thread.start()
        yield
        self.stop_engine.set()  # in-flight sequences are cancelled and their streams closed
        thread.join(timeout=10)

    async def guard(self, request: Request, call_next):
        """The API key (every path but /health) and the declared body size, before any handler runs."""
        key = self.settings.api_key
        if key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return _error_response(
                    ApiError(
                        401,
                        "missing or wrong API key (Authorization: Bearer KEY)",
                        "authentication_error",
                        code="invalid_api_key",
                    )
                )
        length, limit = request.headers.get("content-length"), self.settings.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return _error_response(ApiError(413, f"request body of {length} bytes exceeds {limit}"))
        return await call_next(request)

    async def health(self) -> dict:
        return {"status": "ok"}

    async def models(self) -> dict:
        model = {
            "id": self.settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "exactspec",
            "max_model_len": self.engine.target.max_len,
        }
        return {"object": "list", "data": [model]}

    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(_prometheus(self.engine, self.counters), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request):
        return await self.handle(await self.parse(request, CompletionRequest), chat=False)

    async def chat_completions(self, request: Request):
        return await self.handle(await self.parse(request, ChatRequest), chat=True)

    async def parse(self, request: Request, model_class):
        """The body as ``model_class``: size, JSON, fields and the model's name checked (ApiError otherwise)."""
        body, limit, name = await request.body(), self.settings.max_request_bytes, self.settings.model_name
        if len(body) > limit:
            raise ApiError(413, f"request body of {len(body)} bytes exceeds {limit}")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as error:
            raise ApiError(400, f"the body is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            parsed = model_class.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where) from None
        if parsed.model != name:
            raise ApiError(
                404,
                f"the model `{parsed.model}` does not exist; this server has `{name}`",
                param="model",
                code="model_not_found",
            )
        return parsed

    def prompt_ids(self, body, chat: bool) -> list[int]:
        """The request's prompt as token ids: the chat template over its messages, its text, or its ids checked."""
        if chat:
            try:
                prompt = self.tokenizer.encode_chat([m.model_dump(exclude_none=True) for m in body.messages])
            except ValueError as error:
                raise ApiError(400, str(error), param="messages") from None
        elif isinstance(body.prompt, str):
            prompt = self.tokenizer.encode_prompt(body.prompt)
        else:
            prompt, vocab = list(body.prompt), self.engine.target.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return prompt

    def sequences(self, body, prompt: list[int], default_max: int) -> list[SequenceRequest]:
        """The engine's requests for ``body``'s n choices, every limit and sampling field checked."""
        window, settings = self.engine.target.max_len, self.settings
        if len(prompt) >= window:
            raise ApiError(
                400, f"the prompt has {len(prompt)} tokens; this model's context window is {window}", param="prompt"
            )
        max_tokens = (
            getattr(body, "max_completion_tokens", None) or body.max_tokens or min(default_max, window - len(prompt))
        )
        if max_tokens > settings.max_tokens:
            raise ApiError(
                400, f"max_tokens {max_tokens} exceeds this server's limit of {settings.max_tokens}", param="max_tokens"
            )
        if len(prompt) + max_tokens > window:
            raise ApiError(
                400,
                f"prompt ({len(prompt)} tokens) + max_tokens {max_tokens} exceeds the context window of {window}",
                param="max_tokens",
            )
        if body.n > settings.max_n:
            raise ApiError(400, f"n {body.n} exceeds this server's limit of {settings.max_n}", param="n")
        vocab = self.engine.target.vocab_size
        try:
            bias = {int(t): b for t, b in (body.logit_bias or {}).items()}
            bad = [t for t in [*bias, *(body.stop_token_ids or [])] if t >= vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary of {vocab}")
            params = SamplingParams(
                temperature=body.temperature,
                top_k=max(0, body.top_k),
                top_p=body.top_p,
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=bias,
            )
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        stops = frozenset(body.stop_token_ids or []) | self.tokenizer.eos_token_ids
        return [
            SequenceRequest(
                prompt=tuple(prompt),
                params=params,
                max_new_tokens=max_tokens,
                stop_token_ids=stops,
                seed=None if body.seed is None else sample_seed(body.seed, i),
                speculation=body.speculation,
                top_logprobs=body.top_logprobs_count(),
                verify=body.verify,
            )
            for i in range(body.n)
        ]

    def start(self, requests: list[SequenceRequest], stops: list[str]) -> list[_Choice]:
        """Submit the requests to the engine, unless that would pass the sequences in flight (429)."""
        counters, limit = self.counters, self.settings.max_sequences
        if counters.sequences + len(requests) > limit:
            raise ApiError(
                429,
                f"the server is busy ({counters.sequences} sequences in flight, limit {limit}); retry later",
                "rate_limit_error",
            )
        loop = asyncio.get_running_loop()
        choices = [_Choice(i, self.tokenizer, stops, loop) for i in range(len(requests))]
        for choice, sequence in zip(choices, requests):
            choice.handle = self.engine.submit(sequence, choice.on_tokens, choice.on_finish)
        counters.sequences += len(requests)
        counters.requests += 1
        return choices

    async def handle(self, body, chat: bool):
        """A parsed completion or chat request: streamed, or answered whole."""
        prompt = self.prompt_ids(body, chat)
        for flag in ("return_token_ids", "return_record"):
            if body.stream and getattr(body, flag):
                raise ApiError(400, f"{flag} is given with whole responses, not with stream", param=flag)
        if body.return_record and self.settings.record_base is None:
            raise ApiError(400, "this server keeps no run records", param="return_record")
        requests = self.sequences(body, prompt, 16 if not chat else self.settings.max_tokens)
        choices = self.start(requests, body.stops())
        meta = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            "created": int(time.time()),
            "model": self.settings.model_name,
        }
        stop_ids = requests[0].stop_token_ids
        if body.stream:
            return StreamingResponse(
                _stream(choices, meta, chat, len(prompt), stop_ids, body.include_usage(), self.counters),
                media_type="text/event-stream",
            )
        try:
            texts = await asyncio.gather(*(_collect(c, stop_ids) for c in choices))
        finally:
            _release(choices, self.counters)
        failed = [c for c in choices if c.finish_reason == "error"]
        if failed:
            self.counters.errors += 1
            raise ApiError(500, f"generation failed: {failed[0].handle.error}", "server_error")
        response = _response(choices, texts, meta, chat, prompt if body.return_token_ids else None, len(prompt))
        if body.return_record:
            response["record"] = _record(self.settings.record_base, requests, choices, prompt)
        return response


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return _error_response(error)


def create_app(engine: BatchEngine, tokenizer: TextTokenizer, settings: ServerSettings) -> FastAPI:
    """The HTTP routes over a :class:`ServingApp` (kept as ``app.state.serving``)."""
    serving = ServingApp(engine, tokenizer, settings)
    app = FastAPI(title="exactspec", lifespan=serving.lifespan)
    app.state.serving = serving
    app.add_exception_handler(ApiError, _api_error)
    app.middleware("http")(serving.guard)
    app.get("/health")(serving.health)
    app.get("/v1/models")(serving.models)
    app.get("/metrics")(serving.metrics)
    app.post("/v1/completions")(serving.completions)
    app.post("/v1/chat/completions")(serving.chat_completions)
    return app


def _record(base: dict, requests: list[SequenceRequest], choices: list[_Choice], prompt: list[int]) -> dict:
    """The server's run record completed with this request: its effective sampling, seeds, tokens and figures."""
    from exactspec.decoding.sampling import processor_order
    from exactspec.jobs.records import ACCEPTANCE, DRAW_ORDER_VERSIONS, RESIDUAL

    request = requests[0]
    return {
        **base,
        "kind": "served request",
        "sampling": processor_order(request.params),
        "seed": [r.seed for r in requests],
        "speculation": request.speculation,
        "verify": request.verify,
        "acceptance": ACCEPTANCE[request.verify],
        "residual": RESIDUAL[request.verify],
        "draw_order_version": DRAW_ORDER_VERSIONS[request.verify],
        "gamma_policy": base["gamma_policy"]
        if request.seed is not None or request.speculation != "auto"
        else "batch policy (auto, unseeded)",
        "figures": {
            "prompt_token_ids": prompt,
            "choices": [{"token_ids": c.tokens, **c.handle.figures()} for c in choices],
        },
    }


def _release(choices: list[_Choice], counters: ServerCounters) -> None:
    """Cancel what still runs (a disconnected client) and give the sequences back to the in-flight count."""
    for choice in choices:
        choice.handle.cancel()
    counters.sequences -= len(choices)


async def _collect(choice: _Choice, stop_ids: frozenset[int]) -> str:
    pieces = []
    while True:
        kind, value = await choice.queue.get()
        if kind == "tokens":
            pieces.append(choice.add(value, stop_ids))
            continue
        choice.finish_reason = choice.finish_reason or (value.finish_reason or "stop")
        pieces.append(choice.rest(stop_ids))
        return "".join(pieces)


def _usage(choices: list[_Choice], prompt_tokens: int) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _response(
    choices: list[_Choice], texts: list[str], meta: dict, chat: bool, prompt: list[int] | None, prompt_tokens: int
) -> dict:
    """The whole response; with ``prompt`` (return_token_ids), each choice's prompt and completion token ids."""
    out = []
    for choice, text in zip(choices, texts):
        row = {
            "index": choice.index,
            "finish_reason": choice.finish_reason,
            "logprobs": choice.logprobs(chat),
            "speculation": choice.handle.figures(),
        }
        if prompt is not None:
            row.update(prompt_token_ids=prompt, token_ids=choice.tokens)
        row.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        out.append(row)
    return {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": out,
        "usage": _usage(choices, prompt_tokens),
    }


async def _stream(
    choices: list[_Choice],
    meta: dict,
    chat: bool,
    prompt_tokens: int,
    stop_ids: frozenset[int],
    include_usage: bool,
    counters: ServerCounters,
) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: _Choice, text: str, finish: str | None, extra: dict | None = None) -> str:
        row = {"index": choice.index, "finish_reason": finish, "logprobs": None, **(extra or {})}
        row.update({"delta": {"content": text} if text or finish is None else {}} if chat else {"text": text})
        return f"data: {json.dumps({**meta, 'object': kind, 'choices': [row]})}\n\n"

    pending: dict = {}
    try:
        if chat:
            for choice in choices:
                opening = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield f"data: {json.dumps({**meta, 'object': kind, 'choices': [opening]})}\n\n"
        pending = {asyncio.ensure_future(c.queue.get()): c for c in choices}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                choice = pending.pop(future)
                what, value = future.result()
                if what == "tokens":
                    piece = choice.add(value, stop_ids)
                    if piece:
                        yield chunk(choice, piece, None)
                    pending[asyncio.ensure_future(choice.queue.get())] = choice
                    continue
                if value.finish_reason == "error":
                    counters.errors += 1
                    error = ApiError(500, f"generation failed: {value.error}", "server_error").body()
                    yield f"data: {json.dumps(error)}\n\n"
                    continue
                choice.finish_reason = choice.finish_reason or (value.finish_reason or "stop")
                yield chunk(choice, choice.rest(stop_ids), choice.finish_reason, {"speculation": value.figures()})
        if include_usage:
            usage = {**meta, "object": kind, "choices": [], "usage": _usage(choices, prompt_tokens)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away: its sequences leave the batch
        for future in pending:
            future.cancel()
        _release(choices, counters)


def _prometheus(engine: BatchEngine, counters: ServerCounters) -> str:
    m = engine.metrics
    elapsed = max(1e-9, time.monotonic() - m.started)
    lines = []

    def metric(name: str, kind: str, help_text: str, value: float, labels: str = "") -> None:
        if not any(line.startswith(f"# TYPE {name} ") for line in lines):
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.append(f"{name}{labels} {value}")

    metric("exactspec_generated_tokens_total", "counter", "tokens committed", m.tokens)
    metric("exactspec_tokens_per_second", "gauge", "tokens committed per second since start", m.tokens / elapsed)
    metric("exactspec_drafted_tokens_total", "counter", "draft tokens proposed", m.drafted)
    metric("exactspec_accepted_tokens_total", "counter", "draft tokens accepted", m.accepted)
    metric(
        "exactspec_acceptance_rate",
        "gauge",
        "accepted over drafted tokens",
        m.accepted / m.drafted if m.drafted else 0.0,
    )
    metric("exactspec_target_calls_total", "counter", "batched target calls", m.target_calls)
    metric(
        "exactspec_mean_accepted_length",
        "gauge",
        "tokens committed per sequence and target call",
        m.tokens / max(1, m.sequence_rounds),
    )
    metric("exactspec_queue_depth", "gauge", "sequences waiting for a slot", engine.queue_depth)
    metric("exactspec_batch_size", "gauge", "sequences in the running batch", engine.batch_size)
    metric(
        "exactspec_speculation_decisions_total",
        "counter",
        "steps whose auto sequences speculated (on) or not (off)",
        m.speculation_on,
        '{decision="on"}',
    )
    metric("exactspec_speculation_decisions_total", "counter", "", m.speculation_off, '{decision="off"}')
    for reason, count in sorted(m.finished.items()):
        metric(
            "exactspec_finished_sequences_total",
            "counter",
            "sequences by finish reason",
            count,
            f'{{reason="{reason}"}}',
        )
    memory = _resident_bytes()
    if memory is not None:
        metric("exactspec_resident_memory_bytes", "gauge", "resident memory of the server process", memory)
    metric("exactspec_requests_total", "counter", "requests accepted", counters.requests)
    metric("exactspec_request_errors_total", "counter", "requests that failed inside the model", counters.errors)
    return "\n".join(lines) + "\n"


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux
