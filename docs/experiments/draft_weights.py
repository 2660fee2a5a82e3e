"""A one-off measurement, not part of the package: the shipped SmolLM2 feature draft on ONNX Runtime
(exactspec.models.onnx_draft) in each weight form against torch's float32 runtime: the step's milliseconds (one
token after 25 cached positions, median of 300) and first-position acceptance through the engine (gamma 1, 64
tokens, on the ONNX Runtime target with int8 activations, 12 chat prompts of exactspec.bench.workloads, greedy
and T=1).

    python docs/experiments/draft_weights.py [--threads 2]
"""

import argparse
import statistics
import time

import torch

from exactspec.bench.workloads import CHAT_WORKLOADS
from exactspec.chat import chat_messages
from exactspec.decoding.sampling import GREEDY, SamplingParams
from exactspec.loading import PairSpec
from exactspec.models import onnx_draft
from exactspec.models.feature_runtime import FeatureDraftRuntime
from exactspec.speculator import Speculator


def step_ms(runtime, features: torch.Tensor, tokens: list[int]) -> float:
    u = runtime.project(features)
    g, _ = runtime.forward([(0, u[:25], tokens[:25])])
    times = []
    for _ in range(300):
        began = time.perf_counter()
        runtime.forward([(0, g, [7])])
        times.append((time.perf_counter() - began) * 1000)
        runtime.rollback(0, 25)
    return statistics.median(times)


def acceptance(weights: str, threads: int) -> dict[str, float]:
    onnx_draft.OnnxFeatureDraftRuntime.__init__.__defaults__ = (onnx_draft.SessionSettings(threads), weights)
    speculator = Speculator.load("smollm2", backend="onnx", int8_activations=True, threads=threads, policy_cache=False)
    texts = [text for workload in CHAT_WORKLOADS.values() for text in workload][:12]
    out = {}
    for name, params in (("greedy", GREEDY), ("T=1", SamplingParams())):
        drafted = accepted = 0
        for i, text in enumerate(texts):
            prompt = speculator.tokenizer.encode_chat(chat_messages(text))
            generation = speculator.generate(prompt, max_new_tokens=64, sampling=params, gamma=1, seed=i)
            own = generation.stats.by_source().get("draft", {"drafted": 0, "accepted": 0})
            drafted, accepted = drafted + own["drafted"], accepted + own["accepted"]
        out[name] = accepted / drafted
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    draft = PairSpec("smollm2", backend="lean").resolved().load().draft
    torch.manual_seed(0)
    features = torch.randn(40, draft.fc.in_features)
    tokens = torch.randint(0, 49152, (40,)).tolist()
    print(f"torch float32: step {step_ms(FeatureDraftRuntime(draft, 1, 512), features, tokens):.3f} ms")
    for weights in onnx_draft.DRAFT_WEIGHTS:
        runtime = onnx_draft.OnnxFeatureDraftRuntime(draft, 1, 512, onnx_draft.SessionSettings(args.threads), weights)
        rates = acceptance(weights, args.threads)
        print(
            f"onnx {weights}: step {step_ms(runtime, features, tokens):.3f} ms, first-position acceptance "
            f"{rates['greedy']:.3f} greedy, {rates['T=1']:.3f} T=1",
            flush=True,
        )


if __name__ == "__main__":
    main()
