"""``exactspec audit --llama-server``: every speculative mode of llama-server tested for losslessness, from outside.

llama-server verifies a deterministic draft (its n-gram modes) by sample-and-match: the target samples each drafted
position with its own sampler and keeps the drafted token when the two agree. That is exact whatever the draft, so
each mode's output law must be its plain mode's. The audit starts llama-server plain (the baseline, kept running)
and then each mode in turn on the same GGUF file, each on loopback, and for each sampling configuration tests

- the mode's samples against the exact law, scored locally (:func:`exactspec.certification.audit.audit`: PIT and
  goodness-of-fit tests, Holm over the mode's tests at ``alpha``), and
- the mode's samples against the plain mode's (two-sample KS tests on the same PIT values), which stays valid where
  the local scorer's numbers differ slightly from llama-server's.

The plain mode is audited alone too: it is the audit's own control. Where plain fails a configuration's tests
against the exact law, the scorer and llama-server disagree on that law (settings, or numbers: a truncation such
as top-p is discontinuous in the logits, so a slightly different logit moves its boundary, and a token the scorer
gives probability 0 is sampled); that is no fault of speculation, and a mode is then judged on that configuration
by its two-sample tests against plain alone (:func:`judged`). Leaving tests out of a Holm family keeps its rate.

Each mode's report says how many of its tokens were accepted drafts: a mode that never drafted on these prompts
passes without having been tested, and the table shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from exactspec.bench.llama_server import AUDIT_MODES, DRAFT_MODES, LlamaServer, LlamaServerConfig, llama_server_version
from exactspec.certification.audit import AuditConfig, audit
from exactspec.certification.certify import precision_mode
from exactspec.loading import LoadedPair

__all__ = ["LlamaServerAudit", "audit_llama_server", "audit_prompts", "format_llama_server_table"]


@dataclass(frozen=True)
class LlamaServerAudit:
    server: LlamaServerConfig  # the plain server; each mode is this with its mode
    audit: AuditConfig  # endpoint and baseline are filled in per mode
    modes: tuple[str, ...] = AUDIT_MODES
    draft_model: Path | None = None  # an EAGLE-3 GGUF draft: the draft-eagle3 mode is audited too

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("give at least one llama-server mode")
        if bool(set(self.modes) & set(DRAFT_MODES)) != (self.draft_model is not None):
            raise ValueError("the draft-eagle3 mode, and only it, needs a draft model (an EAGLE-3 GGUF file)")
        if self.audit.api != "llama-server":
            raise ValueError("the audit's api must be llama-server")


def audit_prompts(tokenizer) -> list[list[int]]:
    """The bench's grounded chat prompts (repeat a given text with a change): an answer that copies its prompt is
    where n-gram modes draft, so where their verification is exercised."""
    from exactspec.bench.workloads import CHAT_WORKLOADS
    from exactspec.chat import chat_messages

    return [tokenizer.encode_chat(chat_messages(turn)) for turn in CHAT_WORKLOADS["grounded"]]


def judged(rows: list[dict]) -> list[dict]:
    """Each mode's verdict, where the control allows it (module docstring): ``passed`` counts a configuration's
    tests against the exact law only where plain passed them; ``two_sample_only`` names the other configurations."""
    plain = next((row for row in rows if row["mode"] == "plain" and "error" not in row), None)
    failed = {t["name"].split(" (endpoint)")[0] for t in (plain or {}).get("tests", []) if t["rejected"]}
    for row in rows:
        if "error" in row:
            continue
        kept = row["tests"]
        if row["mode"] != "plain":
            kept = [t for t in kept if "two-sample" in t["name"] or t["name"].split(" (")[0] not in failed]
            row["two_sample_only"] = sorted(failed)
            row["passed"] = not any(t["rejected"] for t in kept)
        row["smallest_judged"] = min(kept, key=lambda t: t["adjusted_p"])
    return rows


def audit_llama_server(
    pair: LoadedPair, prompts: list[list[int]], config: LlamaServerAudit, progress: bool = True
) -> dict:
    """One audit report per mode (module docstring), with llama-server's version; ``passed``: every mode passed,
    plain included (a plain mode that fails is a disagreement on the law, which the audit cannot settle)."""
    rows, baseline_cache = [], {}
    plain_config = replace(config.server, mode="plain")
    with LlamaServer(plain_config) as plain:
        for mode in config.modes:
            if mode == "plain":
                report = audit(
                    pair,
                    prompts,
                    replace(config.audit, endpoint=plain.url, baseline=None),
                    progress,
                    baseline_cache,
                    endpoint_is_baseline=True,
                )  # plain's samples are the other modes' baseline too
            else:
                draft = config.draft_model if mode in DRAFT_MODES else None
                try:
                    with LlamaServer(replace(config.server, mode=mode, draft_model=draft)) as server:
                        report = audit(
                            pair,
                            prompts,
                            replace(config.audit, endpoint=server.url, baseline=plain.url),
                            progress,
                            baseline_cache,
                        )
                except RuntimeError as error:  # one mode this build cannot run: the others are still audited
                    report = {"passed": False, "error": str(error)}
            rows.append({"mode": mode, **report})
    rows = judged(rows)
    return {
        "llama_server": llama_server_version(config.server.binary),
        "binary": str(config.server.binary),
        "model": str(config.server.model),
        "precision": precision_mode(pair),
        "alpha": config.audit.alpha,
        "configs": list(config.audit.configs),
        "passed": all(row["passed"] for row in rows),
        "modes": rows,
    }


def format_llama_server_table(report: dict) -> str:
    """One line per mode: verdict, detectable TV, tokens that were accepted drafts, the smallest adjusted p-value."""
    lines = [
        f"llama-server {report['llama_server']} on {Path(report['model']).name}; scored in {report['precision']}; "
        f"family-wise rate {report['alpha']:g} per mode (Holm); configurations: {', '.join(report['configs'])}",
        f"{'mode':20s} {'verdict':8s} {'TV':>7s} {'drafted tokens':>20s} {'smallest p':>11s}  test",
    ]
    for row in report["modes"]:
        if "error" in row:
            lines.append(f"{row['mode']:20s} {'ERROR':8s} {row['error']}")
            continue
        counts = list((row.get("speculation") or {}).values())
        tokens = sum(c["tokens"] for c in counts)
        accepted = sum(c["accepted"] for c in counts)
        smallest = row["smallest_judged"]
        note = (
            f"  (judged against plain only on {', '.join(row['two_sample_only'])})"
            if row.get("two_sample_only")
            else ""
        )
        lines.append(
            f"{row['mode']:20s} {'PASS' if row['passed'] else 'FAIL':8s} {row['detectable_tv']:7.4f} "
            f"{f'{accepted}/{tokens} accepted':>20s} {smallest['adjusted_p']:11.3g}  {smallest['name']}{note}"
        )
    lines.append(
        "TV: the per-token total-variation distance each mode's tests detect at that rate; drafted tokens: "
        "tokens that were accepted drafts, of all tokens tested; smallest p: of the tests a verdict rests on"
    )
    return "\n".join(lines)
