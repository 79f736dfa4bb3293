"""Turn a scheduled step into model inputs, run the model, sample.

Input preparation works per request (slices of token lists), never per
token: positions and slots come from a few tensor ops over the whole step.
"""

from __future__ import annotations

import itertools
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from disagg.workers.engine.forward_batch import ForwardBatch
from disagg.workers.engine.kv_cache import KVCache
from disagg.workers.engine.models import CausalLM
from disagg.workers.engine.outputs import TokenLogprob
from disagg.workers.engine.request import Request
from disagg.workers.engine.sampler import Sampler, SamplingMetadata, gather_logprobs
from disagg.workers.engine.scheduler import SchedulerOutput


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprob: TokenLogprob | None


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, vocab_size: int, device: torch.device, seed: int = 0,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids  # masked while a request's min_tokens are not made
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.sampler = Sampler(device, seed)

    def execute(self, scheduled: SchedulerOutput,
                on_layer_written: Callable[[int], None] | None = None) -> list[SampledToken]:
        """Run one step; a token for each request whose prompt (or recompute)
        is complete after it. Call before the scheduler's `update`. Prompt
        logprobs asked for are appended to their requests here, chunk by chunk."""
        if scheduled.is_empty:
            return []
        sample_mask = scheduled.sample_mask
        prompt_rows = _prompt_logprob_rows(scheduled)
        batch = self.prepare(scheduled, sample_mask, [row for _, row, _ in prompt_rows])
        batch.on_layer_written = on_layer_written
        logits = self.run_model(batch)  # [N + len(prompt_rows), vocab]
        requests = [r for r, samples in zip(scheduled.requests, sample_mask) if samples]
        if prompt_rows:
            _record_prompt_logprobs(logits[len(requests):], prompt_rows)
        if not requests:
            return []
        meta = SamplingMetadata.from_requests(requests, self.vocab_size, self.device, self.eos_token_ids)
        out = self.sampler(logits[: len(requests)], meta)
        return [SampledToken(r, t, lp) for r, t, lp in zip(requests, out.token_ids, out.logprobs)]

    @torch.inference_mode()
    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """The hot step, tensors in and out: float32 logits [N, vocab] of the
        rows in `batch.logits_indices`."""
        hidden = self.model(batch, self.kv_cache.tensor)  # [T, hidden]
        return self.model.compute_logits(hidden[batch.logits_indices])

    def prepare(self, scheduled: SchedulerOutput, sample_mask: list[bool],
                prompt_rows: Sequence[int] = ()) -> ForwardBatch:
        """The step's tensors; logits come for the sampling rows, then for `prompt_rows`
        (flat token indexes whose next prompt token's logprob is asked for)."""
        requests, query_lens = scheduled.requests, scheduled.num_new_tokens
        starts = [r.num_computed_tokens for r in requests]  # [B] first new position
        if all(n == 1 for n in query_lens):
            ids = [r.token_ids[s] for r, s in zip(requests, starts)]
        else:
            ids = list(itertools.chain.from_iterable(
                r.token_ids[s : s + n] for r, s, n in zip(requests, starts, query_lens)
            ))
        width = max(len(r.block_table) for r in requests)
        tables = [r.block_table + [0] * (width - len(r.block_table)) for r in requests]

        # Built on the CPU, moved once: [B] and [T] index tensors.
        q = torch.tensor(query_lens, dtype=torch.int64)
        start = torch.tensor(starts, dtype=torch.int64)
        block_tables = torch.tensor(tables, dtype=torch.int32)  # [B, max_blocks]
        cu_q = torch.cumsum(q, 0)  # [B] end of each sequence's rows
        if len(ids) == len(requests):
            seq_of_token = torch.arange(len(requests))
            positions = start
        else:
            seq_of_token = torch.repeat_interleave(torch.arange(len(requests)), q)  # [T]
            positions = torch.arange(len(ids)) - (cu_q - q - start).index_select(0, seq_of_token)
        # NOTE: index_select on the flattened table, not table[rows, cols]: on a
        # busy CPU, advanced indexing of small tensors costs milliseconds.
        flat_index = seq_of_token * width + positions // self.block_size
        blocks = block_tables.flatten().index_select(0, flat_index).to(torch.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        logits_indices = (cu_q - 1)[torch.tensor(sample_mask, dtype=torch.bool)]
        if prompt_rows:
            logits_indices = torch.cat([logits_indices, torch.tensor(prompt_rows, dtype=torch.int64)])

        device = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(device),
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            query_lens=list(query_lens),
            context_lens=(start + q).to(torch.int32).to(device),
            block_tables=block_tables.to(device),
            logits_indices=logits_indices.to(device),
        )


def _prompt_logprob_rows(scheduled: SchedulerOutput) -> list[tuple[Request, int, int]]:
    """(request, flat token index, next prompt token) of every row of this step whose
    logits give a prompt logprob not yet computed; in prompt order per request."""
    rows: list[tuple[Request, int, int]] = []
    offset = 0  # flat index of the request's first new token
    for request, n in zip(scheduled.requests, scheduled.num_new_tokens):
        if request.needs_prompt_logits:
            assert request.prompt_logprobs is not None
            start = request.num_computed_tokens
            # Position p predicts token p + 1; a recompute after preemption skips what is done.
            first = max(start, len(request.prompt_logprobs) - 1)
            assert first == len(request.prompt_logprobs) - 1, f"{request}: prompt logprobs would skip positions"
            for p in range(first, min(start + n, request.num_prompt_tokens - 1)):
                rows.append((request, offset + p - start, request.token_ids[p + 1]))
        offset += n
    return rows


# Rows of prompt logits turned into logprobs at once: bounds the [rows, vocab] temporaries.
_PROMPT_LOGPROB_ROWS = 256


def _record_prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int, int]]) -> None:
    """logits: [len(rows), vocab] float32, row i predicting rows[i]'s prompt token."""
    for start in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
        part = rows[start : start + _PROMPT_LOGPROB_ROWS]
        logprobs = torch.log_softmax(logits[start : start + len(part)], dim=-1)  # [R, vocab]
        targets = torch.tensor([token for _, _, token in part], dtype=torch.int64, device=logits.device)
        counts: list[int | None] = [r.sampling_params.prompt_logprobs for r, _, _ in part]
        chosen = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        for (request, _, _), entry, rank in zip(part, gather_logprobs(logprobs, targets, counts), ranks):
            assert request.prompt_logprobs is not None and entry is not None
            request.prompt_logprobs.append(dataclasses.replace(entry, rank=rank))
