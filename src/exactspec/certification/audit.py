"""``exactspec audit``: the certification's tests applied to any OpenAI-compatible completion server, from outside.

The server samples (its speculation on, whatever it is); the local copy of the target's weights scores what it
returned under the declared sampling settings (:func:`exactspec.certification.certify.score_runs`), and the same
PIT and goodness-of-fit tests decide. Only the orders of the vocabulary that need no draft (token id, p, recency)
apply: a black box does not say what it drafted. With a baseline server (the same model, speculation off), the PIT
values of the two are also compared by two-sample KS tests, which stay valid when the local weights' numerics
differ slightly from the server's (a quantized server scored by dense weights shifts both samples alike).

Requests carry the prompt as token ids and ask for ``return_token_ids`` (vLLM's and exactspec's extension), so the
tokens scored are the tokens sampled; every request has its own seed. The number of requests is bounded, and the
audit talks only to the addresses it is given.

A server that takes only text and returns only text (llama-cpp-python's) is audited in text mode: prompts are sent
as text and each completion is re-tokenized. Re-tokenizing is a fixed function of the text, but it can split a
completion differently from how it was sampled, so the PIT values are no longer uniform under the exact law and
only the two-sample tests against a baseline (both sides re-tokenized alike) remain valid; text mode needs one.

llama-server is audited through its own ``/completion`` endpoint (``api="llama-server"``), which takes token ids and
returns them: every sampling field it reads is sent (:func:`exactspec.bench.llama_server.sampling_fields`), so its own
defaults never make a configuration fail for a mismatch of settings, and its counts of drafted and accepted tokens
are kept, so a report says how much of what was tested came from speculation.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import stats
from tqdm import tqdm

from exactspec.bench.llama_server import sampling_fields
from exactspec.certification.certify import (
    AUDIT_CONFIGS,
    MIN_TEST_TOKENS,
    ORDERS,
    precision_mode,
    run_tests,
    score_runs,
)
from exactspec.certification.pit import TestResult, holm, ks_critical_value
from exactspec.decoding.sampling import SamplingParams
from exactspec.loading import LoadedPair
from exactspec.tokenizer import TextTokenizer

__all__ = ["APIS", "AuditConfig", "audit", "format_audit_table"]

MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 64
APIS = (
    "openai",
    "llama-server",
)  # /v1/completions with return_token_ids; llama-server's /completion with return_tokens


@dataclass(frozen=True)
class AuditConfig:
    endpoint: str  # base URL of the server (with or without /v1)
    model: str
    api_key: str | None = None
    baseline: str | None = None  # a server of the same model with speculation off
    configs: tuple[str, ...] = ("T=1",)
    requests: int = 400  # per configuration and server
    max_tokens: int = 48
    alpha: float = 1e-3
    seed: int = 0
    concurrency: int = 8
    timeout: float = 300.0  # seconds per request
    extra_body: dict = field(
        default_factory=dict
    )  # added to every request to the endpoint (e.g. {"speculation": "draft"})
    baseline_extra_body: dict = field(default_factory=dict)
    text_mode: bool = False  # prompts sent as text, completions re-tokenized (module docstring); needs a baseline
    api: str = "openai"  # one of APIS

    def __post_init__(self) -> None:
        if set(self.configs) - set(AUDIT_CONFIGS) or not self.configs:
            raise ValueError(f"configs must be among {', '.join(AUDIT_CONFIGS)}, got {', '.join(self.configs)}")
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.api == "llama-server":
            if self.text_mode:
                raise ValueError("llama-server returns token ids: text mode is for servers that do not")
            for name in self.configs:
                try:
                    sampling_fields(AUDIT_CONFIGS[name], 1)
                except ValueError as error:
                    raise ValueError(f"configuration {name!r}: {error}") from None
        if not 1 <= self.requests * len(self.configs) * (2 if self.baseline else 1) <= MAX_REQUESTS:
            raise ValueError(f"requests x configurations x servers must be in [1, {MAX_REQUESTS}]")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY or self.max_tokens < 1:
            raise ValueError(f"concurrency must be in [1, {MAX_CONCURRENCY}] and max_tokens >= 1")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.text_mode and not self.baseline:
            raise ValueError(
                "text mode re-tokenizes completions, so only a comparison with a baseline is valid: give a baseline"
            )
        for url in (self.endpoint, self.baseline):
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"a server address starts with http:// or https://, got {url!r}")


def _body(model: str, prompt: list[int] | str, params: SamplingParams, max_tokens: int, seed: int, extra: dict) -> dict:
    """The declared sampling settings, in OpenAI's and vLLM's field names."""
    ids = {} if isinstance(prompt, str) else {"return_token_ids": True}
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "seed": seed,
        **ids,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        **extra,
    }


def _sample(
    url: str,
    config: AuditConfig,
    prompts: list[list[int]],
    params: SamplingParams,
    seed: int,
    extra: dict,
    bar: tqdm,
    tokenizer: TextTokenizer,
) -> list[dict]:
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    with httpx.Client(timeout=config.timeout, headers=headers) as client:

        def one(i: int) -> dict:
            prompt = prompts[i % len(prompts)]
            if config.api == "llama-server":
                return _llama_server_one(client, base, prompt, params, config.max_tokens, seed + i, extra, bar)
            sent = _prompt_text(tokenizer, prompt) if config.text_mode else prompt
            choice = _post(
                client, base, "/v1/completions", _body(config.model, sent, params, config.max_tokens, seed + i, extra)
            )["choices"][0]
            bar.update(1)
            if config.text_mode:
                return {"prompt": prompt, "tokens": tokenizer.encode(choice["text"])}
            if "token_ids" not in choice:
                raise RuntimeError(
                    f"{base} does not return token ids (return_token_ids): audit it in text mode, against a baseline"
                )
            return {"prompt": prompt, "tokens": list(choice["token_ids"])}

        with ThreadPoolExecutor(config.concurrency) as pool:
            return list(pool.map(one, range(config.requests)))


def _post(client, base: str, path: str, body: dict) -> dict:
    """POST ``body`` to ``base + path``: the JSON answer, or a RuntimeError naming the server and what it said."""
    import httpx

    try:
        response = client.post(f"{base}{path}", json=body)
    except httpx.HTTPError as error:
        raise RuntimeError(f"{base}: {error}") from None
    if response.status_code != 200:
        raise RuntimeError(f"{base} answered {response.status_code}: {response.text[:300]}")
    return response.json()


def _llama_server_one(
    client, base: str, prompt: list[int], params: SamplingParams, max_tokens: int, seed: int, extra: dict, bar: tqdm
) -> dict:
    """One request to llama-server's /completion: the tokens it sampled, and how many it drafted and accepted."""
    body = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "seed": seed,
        "return_tokens": True,
        **sampling_fields(params, len(prompt) + max_tokens),
        **extra,
    }
    answer = _post(client, base, "/completion", body)
    if "tokens" not in answer:
        raise RuntimeError(f"{base} returned no token ids: is it llama-server?")
    timings = answer.get("timings", {})
    bar.update(1)
    return {
        "prompt": prompt,
        "tokens": list(answer["tokens"]),
        "drafted": int(timings.get("draft_n", 0)),
        "accepted": int(timings.get("draft_n_accepted", 0)),
    }


def _prompt_text(tokenizer: TextTokenizer, prompt: list[int]) -> str:
    """The prompt as text for a text-only server (its BOS left for the server to add)."""
    return tokenizer.decode(prompt[1:] if prompt and prompt[0] == tokenizer.bos_token_id else prompt)


def _two_sample(name: str, audited: dict, baseline: dict) -> list[TestResult]:
    tests = []
    for order in ORDERS:
        a, b = audited["pit"][order], baseline["pit"][order]
        a, b = a[~np.isnan(a)], b[~np.isnan(b)]
        if len(a) >= MIN_TEST_TOKENS and len(b) >= MIN_TEST_TOKENS:
            result = stats.ks_2samp(a, b)
            tests.append(
                TestResult(
                    f"{name}: server vs baseline, {order} order, two-sample KS",
                    len(a) + len(b),
                    float(result.statistic),
                    float(result.pvalue),
                )
            )
    return tests


def audit(
    pair: LoadedPair,
    prompts: list[list[int]],
    config: AuditConfig,
    progress: bool = True,
    baseline_cache: dict | None = None,
    endpoint_is_baseline: bool = False,
) -> dict:
    """Sample from the endpoint (and the baseline), score with ``pair.target``, test; Holm over every test.

    ``baseline_cache`` (configuration name -> the baseline's scored samples) lets several audits against one
    baseline sample it once: it is filled on first use and read after. With ``endpoint_is_baseline`` (an audit of
    the very server later audits take as their baseline, with the same requests and seeds) the endpoint's samples
    fill it, so the baseline is not sampled again."""
    servers = [("endpoint", config.endpoint, config.extra_body)]
    if config.baseline:
        servers.append(("baseline", config.baseline, config.baseline_extra_body))
    bar = tqdm(
        total=config.requests * len(config.configs) * len(servers), desc="audit", unit="req", disable=not progress
    )
    tests, per_config, speculation = [], {}, {}
    for index, name in enumerate(config.configs):
        params = AUDIT_CONFIGS[name]
        scored = {}
        for role, url, extra in servers:
            if role == "baseline" and baseline_cache is not None and name in baseline_cache:
                scored[role] = baseline_cache[name]
                bar.update(config.requests)
                continue
            runs = _sample(url, config, prompts, params, config.seed + 10**6 * index, extra, bar, pair.tokenizer)
            scored[role] = score_runs(pair, runs, params, config.seed + index)
            if baseline_cache is not None and (role == "baseline" or endpoint_is_baseline):
                baseline_cache[name] = scored[role]
            if role == "endpoint" and config.api == "llama-server":
                speculation[name] = {
                    "tokens": sum(len(r["tokens"]) for r in runs),
                    "drafted": sum(r["drafted"] for r in runs),
                    "accepted": sum(r["accepted"] for r in runs),
                }
            if not config.text_mode:
                tests += run_tests(f"{name} ({role})", scored[role], gamma=0)
        if config.baseline:
            tests += _two_sample(name, scored["endpoint"], scored["baseline"])
        per_config[name] = {role: int(len(s["position"])) for role, s in scored.items()}
    bar.close()
    if not tests:
        raise RuntimeError(
            "the servers returned too few tokens to test (a test needs "
            f"{MIN_TEST_TOKENS} per configuration); raise --requests or --max-tokens"
        )
    tests = holm(tests, config.alpha)
    n = min(c["endpoint"] for c in per_config.values())
    detectable = ks_critical_value(n, config.alpha / len(tests))
    if config.text_mode:  # only two-sample tests: the KS distance scales with sqrt(1/n + 1/m)
        m = min(c["baseline"] for c in per_config.values())
        detectable *= math.sqrt(n * (1 / n + 1 / m))
    return {
        "config": {**asdict(config), "api_key": None},
        "precision": precision_mode(pair),
        "passed": not any(t.rejected for t in tests),
        "tokens": per_config,
        "tests": [asdict(t) for t in tests],
        "detectable_tv": detectable,
        "speculation": speculation or None,
    }


def format_audit_table(report: dict) -> str:
    config = report["config"]
    lines = [
        (
            f"audit of {config['endpoint']} ({config['model']}), scored in "
            f"{report['precision']}: {'PASS' if report['passed'] else 'FAIL'} at "
            f"family-wise rate {config['alpha']:g} (Holm over {len(report['tests'])} tests)"
        ),
        (
            f"tokens per configuration: {json.dumps(report['tokens'])}; "
            f"detectable per-token TV about {report['detectable_tv']:.4f}"
        ),
    ]
    for name, counts in (report.get("speculation") or {}).items():
        lines.append(
            f"speculation ({name}): {counts['accepted']} of {counts['tokens']} "
            f"tokens were accepted drafts ({counts['drafted']} drafted)"
        )
    lines.append("smallest adjusted p-values:")
    lines += [
        f"  {t['adjusted_p']:10.3g}  {t['name']} (n={t['n']})"
        for t in sorted(report["tests"], key=lambda t: t["adjusted_p"])[:5]
    ]
    return "\n".join(lines)
