"""A trained draft's acceptance measured through the engine, beside the offline estimate of its model card.

The offline figure (``held_out_acceptance``) runs the draft teacher-forced over the target's held-out answers. Here
the engine generates from the held-out prompts of the same run, drafting one token per round (gamma 1: block and
token-wise verification coincide there) with the trained draft alone (no prompt-lookup routing), and counts what
the target accepts, at T=1 and greedy, per prompt source. The two differ where the engine's own T=1 continuations
differ from the T=0.7 answers the draft was measured on; so the offline estimate is also computed on the engine's own
T=1 sequences (prompt and generated tokens, read by the target as the run's teacher read its answers): where it
agrees with the engine, the gap is the contexts, not the engine.

    python -m exactspec.training.evaluate RUN_DIR [--prompts 20] [--max-new-tokens 64] [--threads 2]

Writes RUN_DIR/engine_acceptance.json and prints one line per source and rule, with the offline estimate on the
held-out answers and (sampled) on the engine's own sequences.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["engine_acceptance", "offline_on_sequences", "main"]


def engine_acceptance(
    speculator,
    prompts: dict[str, list[list[int]]],
    temperature: float,
    max_new_tokens: int,
    sequences: list | None = None,
) -> dict[str, dict]:
    """Per source (and ``"all"``): rounds drafted, tokens accepted and their ratio, from generating each prompt (its
    token ids) with one drafted token per round; seeded by the prompt's place in its source. Each generated sequence
    is appended to ``sequences`` (as a :class:`exactspec.training.teacher.TeacherSequence`) when one is given."""
    from exactspec.decoding.sampling import SamplingParams
    from exactspec.training.teacher import TeacherSequence

    totals: dict[str, dict] = {}
    for source, items in prompts.items():
        drafted = accepted = 0
        for index, ids in enumerate(items):
            generation = speculator.generate(
                ids,
                max_new_tokens=max_new_tokens,
                sampling=SamplingParams(temperature=temperature),
                gamma=1,
                seed=index,
            )
            if sequences is not None:
                sequences.append(TeacherSequence(f"{source}#{index}", ids + generation.tokens, len(ids) - 1, source))
            own = generation.stats.by_source().get("draft", {"drafted": 0, "accepted": 0})
            drafted, accepted = drafted + own["drafted"], accepted + own["accepted"]
        totals[source] = {
            "prompts": len(items),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / max(1, drafted),
        }
    drafted, accepted = sum(t["drafted"] for t in totals.values()), sum(t["accepted"] for t in totals.values())
    totals["all"] = {
        "prompts": sum(t["prompts"] for t in totals.values()),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / max(1, drafted),
    }
    return totals


def offline_on_sequences(draft_dir: Path, target: Path, sequences: list, threads: int) -> dict[str, dict]:
    """The offline estimate (:func:`exactspec.training.feature_draft.acceptance_by_source`, first position) of the
    draft in ``draft_dir`` on ``sequences``, read by the target as train-draft's lean teacher reads its answers
    (:func:`exactspec.training.feature_draft.teacher_model`)."""
    import tempfile

    import torch

    from exactspec.models.eagle import FeatureDraft
    from exactspec.training.feature_draft import acceptance_by_source, teacher_model
    from exactspec.training.teacher import lean_teacher, load_shards, teacher_pass

    torch.set_num_threads(threads)
    model = teacher_model(target)
    draft = FeatureDraft.load(draft_dir).attach(model.decoder)
    draft.embed, draft.head = draft.embed.float(), draft.head.float()
    layers = tuple(sorted(draft.cfg.feature_layers))
    with tempfile.TemporaryDirectory() as shards:
        teacher_pass(lean_teacher(model, layers), layers, sequences, Path(shards), float("inf"))
        rows = load_shards(Path(shards))
    return acceptance_by_source(draft.eval(), rows, 1, model.cfg.vocab_size)


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
    parser.add_argument(
        "--backend",
        choices=["lean", "llamacpp"],
        help="the runtime the engine runs (default: the one the draft's data came from, as its card says)",
    )
    args = parser.parse_args(argv)
    from exactspec.models.eagle import CONFIG_FILE
    from exactspec.speculator import Speculator
    from exactspec.tuning.machine import machine_signature

    draft = args.draft or args.run / "draft"
    card = json.loads((draft / CONFIG_FILE).read_text()).get("card", {})
    target = card["target"]
    backend = args.backend or card.get("data", {}).get("runtime", "lean")
    speculator = Speculator.load(
        target, draft, policy_cache=False, backend=backend, threads=args.threads, lookup_routing=False
    )
    prompts = _held_out_prompts(args.run, args.prompts)
    offline = card.get("held_out_acceptance_by_source", {})
    report = {
        "machine": machine_signature(),
        "threads": args.threads,
        "backend": backend,
        "draft": str(draft),
        "max_new_tokens": args.max_new_tokens,
        "gamma": 1,
    }
    sampled_sequences: list = []
    report["sampled"] = engine_acceptance(speculator, prompts, 1.0, args.max_new_tokens, sampled_sequences)
    report["greedy"] = engine_acceptance(speculator, prompts, 0.0, args.max_new_tokens)
    report["offline_on_engine_sequences"] = offline_on_sequences(draft, Path(target), sampled_sequences, args.threads)
    for name in ("sampled", "greedy"):
        for source, row in report[name].items():
            estimate = offline.get(source, {}).get(name, [float("nan")])[0]
            own = (
                f"  offline on the engine's sequences {report['offline_on_engine_sequences'][source]['sampled'][0]:.3f}"
                if name == "sampled"
                else ""
            )
            print(
                f"{name:7s} {source:10s} engine {row['acceptance']:.3f} ({row['accepted']}/{row['drafted']}, "
                f"{row['prompts']} prompts)  offline {estimate:.3f}{own}"
            )
    (args.run / "engine_acceptance.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"error: {error}") from None
