"""The acceptance prior a draft ships with, measured on the shipped pair over third-party code prompts and written
beside the draft (:func:`exactspec.tuning.priors.write_shipped_prior`)."""

from __future__ import annotations

import json

from exactspec.decoding.sampling import SamplingParams
from exactspec.tuning.priors import measure_acceptance, write_shipped_prior


def main() -> None:
    """python -m exactspec.bench.priors [--target DIR --draft DIR]: measure and write the draft's shipped prior."""
    import argparse

    import torch

    from exactspec.bench.workloads import code_prompts, third_party_sources
    from exactspec.decoding.decoder import SpeculativeDecoder
    from exactspec.decoding.sampling import GREEDY
    from exactspec.loading import default_pair_dirs, load_pair

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--target", default=str(default_pair_dirs()[0]))
    parser.add_argument("--draft", default=str(default_pair_dirs()[1]))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    try:
        pair = load_pair(args.target, args.draft, dtype=torch.bfloat16)
    except (OSError, ValueError) as error:
        parser.exit(2, f"exactspec.bench.priors: error: {error}\n")
    files = third_party_sources()  # odd multiples of 1/(2n): never the files the benchmarks pick (multiples of 1/n)
    chosen = [files[(2 * i + 1) * len(files) // (2 * args.prompts)] for i in range(args.prompts)]
    prompts = [pair.tokenizer.encode_prompt(text)[-512:] for text in code_prompts(args.prompts, files=chosen)]
    by_mode = {
        mode: measure_acceptance(
            SpeculativeDecoder(pair.target, pair.draft, params), prompts, args.gamma, args.max_new_tokens
        )
        for mode, params in (("greedy", GREEDY), ("sampled", SamplingParams()))
    }
    how = (
        f"gamma {args.gamma}, {args.max_new_tokens} new tokens on {args.prompts} third-party code prompts "
        "(files the benchmarks do not use), bfloat16"
    )
    print(write_shipped_prior(args.draft, args.target, by_mode, how), json.dumps(by_mode))


if __name__ == "__main__":
    main()
