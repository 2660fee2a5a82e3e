"""A Hugging Face Llama ``config.json`` as the lean decoder reads it, and its rotary frequencies.

Every key of a config falls in one of four sets, so a checkpoint can never load
with a setting the decoder silently ignores:

* ``READ_KEYS``: read and implemented (sizes, norms, rotary settings, tied head);
* ``FIXED_VALUES``: read only to check they hold the one value implemented
  (``hidden_act == "silu"``, no attention or MLP bias);
* ``IGNORED_KEYS``: keys that do not change a forward pass at inference
  (bookkeeping, training-only settings such as dropout, generation defaults);
* anything else: refused, naming the key and pointing at ``--backend hf``.

Rotary embeddings (``rope_parameters`` in transformers 5, ``rope_scaling`` with a
top-level ``rope_theta`` in 4.x): the default, ``linear`` (positions divided by
``factor``) and ``llama3`` (Llama 3.1's frequency-dependent scaling: wavelengths
longer than ``original_max_position_embeddings / low_freq_factor`` divided by
``factor``, shorter than ``.../ high_freq_factor`` kept, a linear blend between)
are implemented and checked against transformers' logits in the tests; other
types (dynamic NTK, YaRN, LongRoPE) are refused.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

__all__ = [
    "LlamaConfig",
    "RopeScaling",
    "READ_KEYS",
    "FIXED_VALUES",
    "IGNORED_KEYS",
    "inverse_frequencies",
    "rope_tables",
]

READ_KEYS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "head_dim",
        "bos_token_id",
        "eos_token_id",
    }
)
FIXED_VALUES = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
IGNORED_KEYS = frozenset(
    {
        # bookkeeping
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "finetuning_task",
        "task_specific_params",
        "prefix",
        "_attn_implementation_autoset",
        # training-only or output plumbing: no effect on an inference forward pass
        "initializer_range",
        "attention_dropout",
        "use_cache",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "cross_attention_hidden_size",
        "pruned_heads",
        # pretraining_tp > 1 only splits the projections into slices whose products are summed: the same map
        "pretraining_tp",
        # generation defaults older transformers wrote into config.json (exactspec takes sampling settings elsewhere)
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
}


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling the decoder implements: ``linear`` or ``llama3``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"rope type {self.rope_type!r} is not implemented by "
                "the lean backend (it knows default, linear, llama3)"
            )
        if not self.factor > 0 or (self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0):
            raise ValueError(f"invalid rope scaling {self}")


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of a Hugging Face Llama ``config.json`` this decoder needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rope_scaling: RopeScaling | None = None  # None: the default rotary embedding

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """The config from a ``config.json`` dictionary; ValueError on an unknown key, a value the decoder does not
        implement, or a missing or ill-typed field."""
        if d.get("model_type") != "llama":
            raise ValueError(
                f"expected a Llama checkpoint (model_type 'llama'), got model_type {d.get('model_type')!r}"
            )
        unknown = sorted(set(d) - READ_KEYS - IGNORED_KEYS - set(FIXED_VALUES))
        if unknown:
            raise ValueError(
                f"config key(s) {', '.join(map(repr, unknown))} unknown to the lean backend; use --backend hf"
            )
        for key, value in FIXED_VALUES.items():
            if key in d and d[key] != value and not (value is False and d[key] is None):
                raise ValueError(
                    f"{key} = {d[key]!r} is not implemented by the lean backend (only {value!r}); use --backend hf"
                )
        missing = [name for name in REQUIRED_FIELDS if d.get(name) is None]
        if missing:
            raise ValueError(f"config lacks the required field(s) {', '.join(map(repr, missing))}")
        try:
            return cls._from_dict(d)
        except (TypeError, KeyError) as error:
            raise ValueError(f"config has an invalid value: {error}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        rope_theta, scaling = _rope_settings(d)
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            head_dim=d.get("head_dim"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            rope_scaling=scaling,
        )

    def to_hf_dict(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A ``config.json`` that ``transformers.AutoConfig`` reads as a ``LlamaConfig``."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope_scaling"}
        d["head_dim"] = self.head_size
        d.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            mlp_bias=False,
            pretraining_tp=1,
            rope_scaling=None
            if self.rope_scaling is None
            else {**asdict(self.rope_scaling), "rope_theta": self.rope_theta},
            initializer_range=0.02,
            use_cache=True,
            torch_dtype=torch_dtype,
        )
        return d

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_settings(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from transformers 5's ``rope_parameters`` or 4.x's ``rope_theta`` +
    ``rope_scaling``."""
    parameters = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    unknown = set(parameters) - _ROPE_KEYS
    if unknown:
        raise ValueError(
            f"rope setting(s) {', '.join(sorted(unknown))} are not implemented by the lean backend; use --backend hf"
        )
    theta = float(parameters.get("rope_theta", d.get("rope_theta") or 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "default":
        return theta, None
    fields_given = {
        k: v
        for k, v in parameters.items()
        if k in {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    }
    return theta, RopeScaling(rope_type, **fields_given)


def inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:  # (head_size / 2,) float32
    """theta^(-2i/d) per rotary pair, scaled as ``cfg.rope_scaling`` says (see the module docstring)."""
    hd = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelength = scaling.original_max_position_embeddings / scaling.high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / scaling.factor, inv_freq)
    blend = (scaling.original_max_position_embeddings / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * scaled / scaling.factor + blend * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled)


def rope_tables(cfg: LlamaConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each ``(max_len, head_size)`` float32 (Hugging Face's rotate-half layout)."""
    t = torch.arange(max_len, dtype=torch.int64).float()  # (L,)
    freqs = torch.outer(t, inverse_frequencies(cfg))  # (L, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (L, hd)
    return emb.cos(), emb.sin()
