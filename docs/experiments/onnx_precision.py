"""A one-off measurement, not part of the package (docs/runtimes.md, "ONNX Runtime"): how far SmolLM2's logits on
ONNX Runtime (float32 and int8 activations) and on torch's q4 bfloat16 path are from the file's weights computed in
float32, over four chat prompts and 48 greedy tokens each.

    python docs/experiments/onnx_precision.py
"""

import torch

from exactspec.loading import PACKAGED_MODELS, load_pair
from exactspec.models.onnx_runtime import OnnxRuntime

PROMPTS = [
    "Explain how a hash table works.",
    "Write a haiku about the sea.",
    "What is the capital of Australia?",
    "Summarise the causes of the French Revolution.",
]


def main() -> None:
    path = PACKAGED_MODELS["smollm2"].path()
    reference = load_pair(path, None, backend="lean", dtype=torch.float32, weights="dense")
    sequences = []
    for text in PROMPTS:  # each prompt and the reference's own greedy answer
        ids = reference.tokenizer.encode_chat([{"role": "user", "content": text}])
        for _ in range(48):
            ids.append(int(reference.target.prefill(ids)[-1].argmax()))
        sequences.append(ids)

    def onnx(level: int):
        runtime = OnnxRuntime.from_checkpoint(path, slots=1, max_len=512, threads=2, accuracy_level=level)

        def logits(ids: list[int]) -> torch.Tensor:  # (T, V)
            runtime.rollback(0, 0)
            return runtime.forward([(0, ids)])[0]

        return logits

    lean = load_pair(path, None, backend="lean", dtype=torch.bfloat16, weights="q4").target
    arms = {"onnx float32": onnx(0), "onnx int8 activations": onnx(4), "lean q4 bfloat16": lean.prefill}
    for name, logits_of in arms.items():
        worst, kl, agree, total = 0.0, [], 0, 0
        for ids in sequences:
            base, got = reference.target.prefill(ids), logits_of(ids)  # (T, V) x 2
            worst = max(worst, (got - base).abs().max().item())
            p, q = base.log_softmax(-1), got.log_softmax(-1)
            kl += (p.exp() * (p - q)).sum(-1).tolist()
            agree, total = agree + int((got.argmax(-1) == base.argmax(-1)).sum()), total + len(ids)
        kl = torch.tensor(kl)
        print(
            f"{name}: max |logit diff| {worst:.4f}, KL(file || it) mean {kl.mean():.2e} max {kl.max():.2e}, "
            f"argmax agrees {agree}/{total}"
        )


if __name__ == "__main__":
    main()
