"""Per-request sampling settings: the engine-side form of the sampling fields
of an OpenAI request and of xLLM's `DisaggRequest`."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_N = 16
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one sequence.

    `n` is carried for the edges (OpenAI and `DisaggRequest`); the engine runs
    one sequence per request, and the serving layer fans `n > 1` out into `n`
    requests that share the prompt's cached blocks.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and k alternatives
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self) -> list[str]:
        out = []
        if not 1 <= self.n <= MAX_N:
            out.append(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.max_tokens < 1:
            out.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        floats = {
            "temperature": (self.temperature, 0.0, 2.0),
            "top_p": (self.top_p, 0.0, 1.0),
            "min_p": (self.min_p, 0.0, 1.0),
            "presence_penalty": (self.presence_penalty, -2.0, 2.0),
            "frequency_penalty": (self.frequency_penalty, -2.0, 2.0),
            "repetition_penalty": (self.repetition_penalty, 0.0, 2.0),
        }
        for name, (value, lo, hi) in floats.items():
            if not (math.isfinite(value) and lo <= value <= hi):
                out.append(f"{name} must be a number between {lo} and {hi}, got {value}")
        if self.top_p == 0.0:
            out.append("top_p must be greater than 0")
        if self.repetition_penalty == 0.0:
            out.append("repetition_penalty must be greater than 0")
        if self.top_k < -1:
            out.append(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            out.append(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
