"""The OpenAI request bodies the server accepts, checked before anything runs.

Field names and defaults follow OpenAI's completions and chat completions APIs; vLLM's extensions are accepted
as extra fields (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``), and exactspec adds
``speculation`` (``off``, ``draft``, ``lookup`` or ``auto``) and ``verify`` (``block``, the default, or ``token``: the
rule for sampled drafts); ``return_token_ids`` (as in vLLM) adds each choice's
``prompt_token_ids`` and ``token_ids``, which ``exactspec audit`` scores; ``return_record`` adds the request's run
record. Unknown fields are refused, so a typo is an error
rather than a silently ignored setting.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from exactspec.decoding.block import RULES
from exactspec.decoding.engine import SPECULATION_MODES

__all__ = ["ChatRequest", "CompletionRequest", "ChatMessage"]


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off (vLLM's -1 accepted)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    speculation: str = "auto"
    verify: str = "block"
    return_token_ids: bool = False
    return_record: bool = False  # exactspec: the request's run record (exactspec.jobs.records) in the response
    user: str | None = None

    @field_validator("speculation", "verify")
    @classmethod
    def _one_of(cls, value: str, info: ValidationInfo) -> str:
        choices = SPECULATION_MODES if info.field_name == "speculation" else RULES
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
