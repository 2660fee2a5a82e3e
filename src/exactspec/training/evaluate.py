"""A trained draft's acceptance measured through the engine, beside the offline estimate of its model card.

The offline figure (``held_out_acceptance``) runs the draft teacher-forced over the target's held-out answers. Here
the engine generates from the held-out prompts of the same run, drafting one token per round (gamma 1: block and
token-wise verification coincide there) with the trained draft alone (no prompt-lookup routing), and counts what
the target accepts, at T=1 and greedy, per prompt source. The two differ where the engine's own T=1 continuations
differ from the T=0.7 answers the draft was measured on.

    python -m exactspec.training.evaluate RUN_DIR [--prompts 20] [--max-new-tokens 64] [--threads 2]

Writes RUN_DIR/engine_acceptance.json and prints one line per source.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["engine_acceptance", "main"]


def engine_acceptance(speculator, prompts: dict[str, list[list[int]]], temperature: float, max_new_tokens: int) -> dict[str, dict]:
    """Per source (and ``"all"``): rounds drafted, tokens accepted and their ratio, from generating each prompt (its
    token ids) with one drafted token per round; seeded by the prompt's place in its source."""
    from exactspec.decoding.sampling import SamplingParams

    totals: dict[str, dict] = {}
    for source, items in prompts.items():
        drafted = accepted = 0
        for index, ids in enumerate(items):
            completion = speculator.generate(ids, max_new_tokens, SamplingParams(temperature=temperature), gamma=1, seed=index)
            own = completion.generation.stats.by_source().get("draft", {"drafted": 0, "accepted": 0})
            drafted, accepted = drafted + own["drafted"], accepted + own["accepted"]
        totals[source] = {"prompts": len(items), "drafted": drafted, "accepted": accepted, "acceptance": accepted / max(1, drafted)}
    drafted, accepted = sum(t["drafted"] for t in totals.values()), sum(t["accepted"] for t in totals.values())
    totals["all"] = {"prompts": sum(t["prompts"] for t in totals.values()), "drafted": drafted, "accepted": accepted,
                     "acceptance": accepted / max(1, drafted)}
    return totals


def _held_out_prompts(run: Path, per_source: int) -> dict[str, list[list[int]]]:
    """The first ``per_source`` held-out prompts of each source, as the token ids the target was given."""
    import torch

    from exactspec.training.teacher import load_shards

    by_source: dict[str, list[list[int]]] = {}
    for row in load_shards(run / "held_out"):
        items = by_source.setdefault(row.get("source", "chat"), [])
        if len(items) < per_source:
            items.append(row["ids"][: row["loss_from"] + 1].to(torch.int64).tolist())
    return by_source


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a train-draft run directory (its draft/ and held_out/ shards)")
    parser.add_argument("--draft", type=Path, help="the draft to measure (default: RUN/draft)")
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts per source")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", choices=["lean", "llamacpp"],
                        help="the runtime the engine runs (default: the one the draft's data came from, as its card says)")
    args = parser.parse_args(argv)
    from exactspec.machine import machine_signature
    from exactspec.models.eagle import CONFIG_FILE
    from exactspec.speculator import Speculator

    draft = args.draft or args.run / "draft"
    card = json.loads((draft / CONFIG_FILE).read_text()).get("card", {})
    target = card["target"]
    backend = args.backend or card.get("data", {}).get("runtime", "lean")
    speculator = Speculator.load(target, draft, policy_cache=False, backend=backend, threads=args.threads, lookup_routing=False)
    prompts = _held_out_prompts(args.run, args.prompts)
    offline = card.get("held_out_acceptance_by_source", {})
    report = {"machine": machine_signature(), "threads": args.threads, "backend": backend, "draft": str(draft),
              "max_new_tokens": args.max_new_tokens, "gamma": 1}
    for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        report[name] = engine_acceptance(speculator, prompts, temperature, args.max_new_tokens)
        for source, row in report[name].items():
            estimate = offline.get(source, {}).get(name, [float("nan")])[0]
            print(f"{name:7s} {source:10s} engine {row['acceptance']:.3f} ({row['accepted']}/{row['drafted']}, "
                  f"{row['prompts']} prompts)  offline {estimate:.3f}")
    (args.run / "engine_acceptance.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"error: {error}") from None
