"""Per-request sampling settings: the engine-side form of the sampling fields
of an OpenAI request and of xLLM's `DisaggRequest`."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_N = 16
MAX_LOGPROBS = 20
# Token ids and top_k travel as int32 (xLLM's protobuf) and index int64 tensors.
MAX_TOKEN_ID = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]
GREEDY_TEMPERATURE = 1e-5  # a temperature below it samples greedily (vLLM's threshold)


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
    # None: none; k: each prompt token's logprob (the first has none) and its k alternatives,
    # from the prompt's own forward (a request asking for them skips the prefix cache)
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), ids ascending
    min_tokens: int = 0  # end-of-sequence, stop tokens and stop strings wait until this many are made
    skip_special_tokens: bool = True
    grammar: str | None = None  # llguidance's grammar text (engine/grammar.py): constrained decoding
    # Tokens of this sequence already made elsewhere (a migrated stream continues after them, and
    # they end its prompt): a seeded generator starts past their draws and a grammar after them,
    # so the continuation is exact.
    draws_made: int = 0

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
        if not -1 <= self.top_k <= MAX_TOKEN_ID:
            out.append(f"top_k must be -1, 0 or a positive count up to {MAX_TOKEN_ID}, got {self.top_k}")
        if not 0 <= self.draws_made <= MAX_TOKEN_ID:
            out.append(f"draws_made must be between 0 and {MAX_TOKEN_ID}, got {self.draws_made}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            out.append(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}")
        bad_stops = [t for t in self.stop_token_ids if not 0 <= t <= MAX_TOKEN_ID]
        if bad_stops:
            out.append(f"stop_token_ids must be token ids in [0, {MAX_TOKEN_ID}], got {bad_stops[:5]}")
        for name, count in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if count is not None and not 0 <= count <= MAX_LOGPROBS:
                out.append(f"{name} must be between 0 and {MAX_LOGPROBS}, got {count}")
        bad_bias = [(t, v) for t, v in self.logit_bias
                    if not (0 <= t <= MAX_TOKEN_ID and math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS)]
        if bad_bias:
            out.append(f"logit_bias must map token ids in [0, {MAX_TOKEN_ID}] to numbers between "
                       f"{-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bad_bias[:5]}")
        # A max_tokens under 1 is named above; min_tokens is checked against a valid one only.
        if not 0 <= self.min_tokens <= max(self.max_tokens, 1):
            out.append(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        return out

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflow float32 (the draw would be NaN):
        # such a temperature means greedy, as in vLLM.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
