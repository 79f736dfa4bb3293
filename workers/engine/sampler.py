"""Pick the next token of every sampling sequence from its logits, in a few
batched tensor ops.

Order, as in Hugging Face `generate`: `logit_bias` and the `min_tokens` mask
(end-of-sequence and stop tokens at -inf until enough are made), penalties,
then temperature, top-k, top-p and min-p, then a draw. Greedy rows take the
argmax of the penalized logits. Reported logprobs are those of the raw
model distribution (what OpenAI's `logprobs` means), after the grammar's mask
on a constrained row (structured outputs, as vLLM reports them).

The draw is `argmax(probs / q)` with `q ~ Exp(1)`, which picks token i with
probability probs[i]; a seeded request fills its row of `q` from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.workers.engine.outputs import TokenLogprob
from disagg.workers.engine.request import Request


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors on the logits' device.
    Every [N] tensor has one row per sampling sequence."""

    temperatures: torch.Tensor  # [N] float32, 1.0 on greedy rows (they never divide)
    greedy: torch.Tensor  # [N] bool
    top_ks: torch.Tensor | None  # [N] int64, vocab size where no cut; None: no row cuts
    top_ps: torch.Tensor | None  # [N] float32; None: no row cuts
    min_ps: torch.Tensor | None  # [N] float32; None: no row cuts
    presence: torch.Tensor | None  # [N, 1] float32; None: no penalties in the batch
    frequency: torch.Tensor | None  # [N, 1] float32
    repetition: torch.Tensor | None  # [N, 1] float32
    output_counts: torch.Tensor | None  # [N, V] float32, occurrences of each token in the output
    seen: torch.Tensor | None  # [N, V] bool, token occurs in the prompt or the output
    generators: list[torch.Generator | None]  # [N]
    num_logprobs: list[int | None]  # [N], alternatives each row reports
    all_greedy: bool
    allowed: torch.Tensor | None = None  # [N, V] bool, the grammar's tokens; None: no row constrained
    bias: torch.Tensor | None = None  # [N, V] float32 added to the logits; None: no row has one

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab_size: int, device: torch.device,
                      eos_token_ids: frozenset[int] = frozenset()) -> SamplingMetadata:
        params = [r.sampling_params for r in requests]
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)

        def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        # A cut beyond the vocabulary keeps everything: clamped, it never overflows the tensor.
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        presence = frequency = repetition = output_counts = seen = None
        if any(p.has_penalties for p in params):
            presence = column([p.presence_penalty for p in params]).unsqueeze(1)
            frequency = column([p.frequency_penalty for p in params]).unsqueeze(1)
            repetition = column([p.repetition_penalty for p in params]).unsqueeze(1)
            output_counts = _token_counts([r.output_token_ids for r in requests], vocab_size, device)
            seen = _token_counts([r.token_ids for r in requests], vocab_size, device) > 0
        return cls(
            temperatures=column([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_ks=None if all_greedy or min(top_ks) >= vocab_size else column(top_ks, torch.int64),
            top_ps=None if all_greedy or all(p.top_p >= 1.0 for p in params) else column([p.top_p for p in params]),
            min_ps=None if all_greedy or all(p.min_p <= 0.0 for p in params) else column([p.min_p for p in params]),
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            output_counts=output_counts,
            seen=seen,
            generators=[r.generator for r in requests],
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all_greedy,
            allowed=_allowed_tokens(requests, vocab_size, device),
            bias=_logit_bias(requests, vocab_size, device, eos_token_ids),
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: list[TokenLogprob | None]  # [N], None where the request asked for none


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        # Randomness of the rows without a seed of their own.
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [N, V] float32, one row per sampling sequence."""
        assert logits.dim() == 2 and logits.dtype == torch.float32, "logits must be float32 [N, V]"
        if meta.allowed is not None:
            # Before everything, logprobs included (as vLLM): a constrained row's
            # distribution is the model's over the tokens the grammar allows.
            logits = logits.masked_fill(~meta.allowed, float("-inf"))
        raw_logprobs = None
        if any(k is not None for k in meta.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if meta.bias is not None:
            logits = logits + meta.bias
        logits = apply_penalties(logits, meta)
        tokens = logits.max(dim=-1).indices  # [N]; the first of ties, as argmax, whose CPU kernel is half as fast
        if not meta.all_greedy:
            sampled = sample(logits, meta, self.generator)
            tokens = torch.where(meta.greedy, tokens, sampled)
        token_list: list[int] = tokens.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_list, [None] * len(token_list))
        return SamplerOutput(token_list, gather_logprobs(raw_logprobs, tokens, meta.num_logprobs))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens, as in HF), then frequency and
    presence (output tokens only, as in OpenAI). Returns a new tensor."""
    if meta.seen is None:
        return logits
    assert meta.repetition is not None and meta.frequency is not None and meta.presence is not None
    assert meta.output_counts is not None
    # A repeated token's logit moves towards zero: divided when positive, multiplied when negative.
    penalized = torch.where(logits > 0, logits / meta.repetition, logits * meta.repetition)
    logits = torch.where(meta.seen, penalized, logits)
    logits = logits - meta.frequency * meta.output_counts
    return logits - meta.presence * (meta.output_counts > 0).to(logits.dtype)


def sample(logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row after temperature, top-k, top-p and min-p;
    `generator` serves the rows without one of their own. [N, V] -> [N]"""
    logits = logits / meta.temperatures.unsqueeze(1)
    logits = mask_top_k_top_p(logits, meta.top_ks, meta.top_ps)
    if meta.min_ps is not None:
        logits = mask_min_p(logits, meta.min_ps)
    probs = torch.softmax(logits, dim=-1)
    q = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(meta.generators) if g is not None]
    if len(seeded) < len(meta.generators):
        q.exponential_(generator=generator)
    for i in seeded:
        q[i].exponential_(generator=meta.generators[i])
    # NOTE: a draw of exactly 0 would make 0/0 = NaN, which argmax prefers.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance a request's generator past one `sample` draw, as if it had sampled
    a token here (a decode continuing a seeded request whose first token the
    prefill drew)."""
    torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)


def mask_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top k, then outside the
    smallest set whose probability reaches top p (the best token always stays)."""
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    if top_ks is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= top_ks.unsqueeze(1), float("-inf"))
    if top_ps is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Probability mass strictly before each token: drop it once that already reaches top p.
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p = 1 cut nothing, even where rounding lifts the mass to 1.
        limit = torch.where(top_ps >= 1.0, float("inf"), top_ps).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= limit, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def mask_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token less likely than min_p times the row's best one."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps all.
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_ps).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprob | None]:
    """The sampled token's logprob and the top alternatives, for the rows that asked."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()  # [N]
    k = max((n for n in num_logprobs if n is not None), default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    top_v = top_values.tolist() if top_values is not None else []
    top_i = top_ids.tolist() if top_ids is not None else []
    token_list = tokens.tolist()
    out: list[TokenLogprob | None] = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        # A grammar's mask leaves fewer than n possible tokens: the impossible ones are no alternatives.
        top = tuple((t, v) for t, v in zip(top_i[row][:n], top_v[row][:n]) if v > float("-inf")) if n else ()
        out.append(TokenLogprob(token_list[row], chosen[row], top))
    return out


def _allowed_tokens(requests: Sequence[Request], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """[N, V] bool: every token on unconstrained rows, the grammar's on the others;
    None when no row is constrained (such a batch pays nothing)."""
    rows = [(i, r.constraint) for i, r in enumerate(requests) if r.constraint is not None]
    if not rows:
        return None
    allowed = torch.ones(len(requests), vocab_size, dtype=torch.bool)
    for i, constraint in rows:
        allowed[i] = constraint.allowed()
    return allowed.to(device)


def _logit_bias(requests: Sequence[Request], vocab_size: int, device: torch.device,
                eos_token_ids: frozenset[int]) -> torch.Tensor | None:
    """[N, V] float32: each row's `logit_bias`, and -inf on the tokens that would end
    it before its `min_tokens` (EOS unless ignored, stop tokens); None when no row has either."""
    rows = [(i, r) for i, r in enumerate(requests) if r.sampling_params.logit_bias or r.num_min_tokens_left]
    if not rows:
        return None
    bias = torch.zeros(len(requests), vocab_size, dtype=torch.float32)
    for i, request in rows:
        params = request.sampling_params
        for token_id, value in params.logit_bias:  # in the vocabulary: LLMEngine.check_request
            bias[i, token_id] = value
        if request.num_min_tokens_left:
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            bias[i, [t for t in ends if t < vocab_size]] = float("-inf")
    return bias.to(device)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] float32: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    width = max((len(t) for t in token_lists), default=0)
    if width:
        # Pad with an extra column id (vocab_size) that is cut off afterwards.
        padded = torch.tensor(
            [t + [vocab_size] * (width - len(t)) for t in token_lists], dtype=torch.int64, device=device
        )
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
