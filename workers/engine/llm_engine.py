"""The synchronous engine: requests in, one step at a time, outputs out.

One request's life:
1. `add_request` validates it and queues it (WAITING).
2. `step` schedules it, runs its prompt (in chunks if long) through the
   model, and samples a token once the prompt is done (RUNNING).
3. Each later step decodes one token; `postprocess` appends it, updates the
   text and checks the stop conditions.
4. A stop condition, `max_tokens`, the context length or `abort_request`
   finishes it and frees its blocks; its last output says why.

Work split across workers (PD) uses two more ways in and out: a request added
with `hold_after_first_token` leaves the batch after its first token, holding
its blocks until `release_request`; `reserve_request` allocates a prompt's
blocks for KV computed elsewhere, and `admit_request` starts decoding it
after the first token sampled there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING

from disagg.workers.engine.block_manager import BlockManager
from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.kv_cache import KVCache, KVCacheSpec, resolve_num_blocks
from disagg.workers.engine.model_runner import ModelRunner, SampledToken
from disagg.workers.engine.models.packing import packing_available
from disagg.workers.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from disagg.workers.engine.request import Request, RequestStatus
from disagg.workers.engine.grammar import Grammars
from disagg.workers.engine.sampler import skip_draw
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from disagg.workers.engine.loader import LoadedModel
    from disagg.workers.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Called with each step's schedule before its forward; may return a callback
# that the forward runs with each layer's index once that layer's KV is written.
LayerHook = Callable[[SchedulerOutput], Callable[[int], None] | None]


class OutOfBlocks(RuntimeError):
    """No free blocks to reserve for the prompt now (it may fit later)."""


class PromptTooLarge(RuntimeError):
    """The prompt can never fit this engine's context or KV pool."""


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, tokenizer: Tokenizer | None = None) -> None:
        model_dtype = next(loaded.model.parameters()).dtype
        if model_dtype != config.torch_dtype:  # the KV pool takes the config's dtype: the two must meet
            raise ValueError(f"the model was loaded in {model_dtype}, the engine runs {config.torch_dtype} "
                             f"(dtype {config.dtype!r})")
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = tokenizer
        device = config.torch_device

        # --- KV pool ------------------------------------------------------
        spec = KVCacheSpec(
            num_layers=loaded.config.num_layers,
            num_kv_heads=loaded.config.num_kv_heads,
            head_dim=loaded.config.head_dim,
            block_size=config.block_size,
            dtype=config.torch_dtype,
        )
        self.kv_cache = KVCache(spec, resolve_num_blocks(config, spec, device), device)
        max_len = config.resolve_max_model_len(loaded.config.max_model_len)
        pool_tokens = self.kv_cache.num_blocks * config.block_size
        if pool_tokens < max_len:
            # A sequence longer than the pool could never finish, however much we preempt.
            logger.warning("KV pool holds %d tokens: max_model_len lowered from %d", pool_tokens, max_len)
            max_len = pool_tokens
        self.max_model_len = max_len

        # --- scheduling and execution ---------------------------------------
        if config.pack_cpu_weights and packing_available(device, config.torch_dtype):
            loaded.model.pack_weights()
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        eos = frozenset(loaded.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
        self.model_runner = ModelRunner(loaded.model, self.kv_cache, loaded.config.vocab_size, device, config.seed,
                                        eos)
        self.stop_checker = StopChecker(eos, self.max_model_len)
        self.layer_hook: LayerHook | None = None
        self._finished_between_steps: list[Request] = []  # reported by the next step
        self.grammars = Grammars(tokenizer, loaded.config.vocab_size) if tokenizer else None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model and its tokenizer, then build the engine."""
        from disagg.workers.engine.loader import load_model
        from disagg.workers.engine.tokenizer import Tokenizer

        loaded = load_model(config.model, config.torch_dtype, config.torch_device)
        return cls(config, loaded, Tokenizer.from_dir(loaded.model_dir))

    # --- requests -----------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when the request can never run. Reads only fixed
        settings, so any thread may call it."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context holds "
                f"{self.max_model_len}, including at least one generated token"
            )
        if params.draws_made > len(prompt_token_ids):  # each draw made a token that now ends the prompt
            raise ValueError(f"draws_made ({params.draws_made}) exceeds the prompt's {len(prompt_token_ids)} tokens")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        if any(not s for s in params.stop):
            raise ValueError("stop strings must not be empty")
        if params.grammar is not None and self.tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer; this engine has none")

    def new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    hold_after_first_token: bool = False) -> Request:
        """A checked request with its detokenizer, not yet known to the scheduler.
        Reads only fixed settings, so any thread may call it."""
        self.check_request(prompt_token_ids, params)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = self.tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens)
        constraint = None
        if params.grammar is not None and self.grammars is not None:
            constraint = self.grammars.constraint(params.grammar)
            # A migrated stream's prompt ends with the tokens it already made: the grammar has seen them.
            for token_id in prompt_token_ids[len(prompt_token_ids) - params.draws_made:]:
                constraint.advance(token_id)
        request = Request(request_id, prompt_token_ids, params, self.config.block_size, detokenizer,
                          device=self.model_runner.device, hold_after_first_token=hold_after_first_token,
                          constraint=constraint)
        if request.generator is not None and not params.is_greedy:
            for _ in range(params.draws_made):  # drawn where the sequence began (a migrated stream)
                skip_draw(request.generator, self.model_config.vocab_size)
        return request

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    hold_after_first_token: bool = False) -> None:
        request = self.new_request(request_id, prompt_token_ids, params, hold_after_first_token)
        self._check_unused(request_id)
        self.scheduler.add(request)

    def reserve_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        reuse_prefix: bool = False) -> list[int]:
        """Allocate the blocks of a prompt whose KV is computed elsewhere; their ids, in prompt order.

        With `reuse_prefix` the leading blocks this engine's prefix cache already holds are
        shared rather than allocated: only the rest need the KV (`reserved_prefix_blocks` says
        how many are shared). Raises PromptTooLarge when it can never fit, OutOfBlocks when it
        does not fit now."""
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLarge(f"{len(prompt_token_ids)} prompt tokens; the context holds {self.max_model_len}")
        request = self.new_request(request_id, prompt_token_ids, params)
        self._check_unused(request_id)
        if request.num_blocks > self.block_manager.num_blocks:
            raise PromptTooLarge(f"the prompt needs {request.num_blocks} blocks of {self.block_manager.num_blocks}")
        cached = self.block_manager.match_prefix(request) if reuse_prefix else []
        if not self.scheduler.can_reserve(request, cached):
            raise OutOfBlocks(f"{request.num_blocks - len(cached)} blocks needed, "
                              f"{self.block_manager.num_free_blocks} free")
        self.scheduler.reserve(request, cached)
        return list(request.block_table)

    def num_cached_prompt_tokens(self, request: Request) -> int:
        """Prompt tokens of `request` (not yet scheduled) that the prefix cache holds now."""
        return len(self.block_manager.match_prefix(request)) * self.config.block_size

    def reserved_prefix_blocks(self, request_id: str) -> int:
        """How many leading blocks of a reserved request came from the prefix cache."""
        request = self._live(request_id, RequestStatus.RESERVED)
        return request.num_computed_tokens // self.config.block_size

    def admit_request(self, request_id: str, token_id: int) -> None:
        """A reserved request's prompt KV is in its blocks: decode on after `token_id`,
        the first token, which was sampled (and sent to the client) elsewhere."""
        request = self._live(request_id, RequestStatus.RESERVED)
        self.scheduler.admit_running(request)
        request.append_token(token_id)
        if request.generator is not None and not request.sampling_params.is_greedy:
            skip_draw(request.generator, self.model_config.vocab_size)  # the other worker's draw of token_id
        status = self.stop_checker.check(request)
        request.num_sent_tokens = 1
        request.num_sent_chars = self.stop_checker.num_visible_chars(request)
        if status is not None:
            self.scheduler.finish(request, status)
            self.report_finished(request)

    def release_request(self, request_id: str) -> bool:
        """Free the blocks of a held request; False when no request holds them."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status is not RequestStatus.HELD:
            return False
        self.scheduler.release(request)
        return True

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _live(self, request_id: str, status: RequestStatus) -> Request:
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status is not status:
            raise ValueError(f"no {status.value} request {request_id!r}")
        return request

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and free its blocks; its final output comes with the
        next step. False when the request is unknown or already finished."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return False
        self.report_finished(request)
        return True

    def report_finished(self, request: Request) -> None:
        """Report a request that finished outside a step with the next step's outputs."""
        self._finished_between_steps.append(request)

    # --- the loop -----------------------------------------------------------

    def step(self, max_tokens: int | None = None) -> list[RequestOutput]:
        """One step of at most `max_tokens` tokens (None: the configured budget)."""
        scheduled = self.scheduler.schedule(max_tokens)
        on_layer_written = self.layer_hook(scheduled) if self.layer_hook and not scheduled.is_empty else None
        sampled = self.model_runner.execute(scheduled, on_layer_written)
        self.scheduler.update(scheduled)
        return self.postprocess(sampled)

    def postprocess(self, sampled: list[SampledToken]) -> list[RequestOutput]:
        """Take in a step's sampled tokens; the outputs of the step."""
        outputs = [self.output(r) for r in self._finished_between_steps]
        self._finished_between_steps.clear()
        for token in sampled:
            request = token.request
            request.append_token(token.token_id)
            if token.logprob is not None:
                request.pending_logprobs.append(token.logprob)
            if request.hold_after_first_token:
                # No text or stop checks here: the worker that takes it over owns them.
                self.scheduler.hold(request)
                outputs.append(self.output(request))
                continue
            status = self.stop_checker.check(request)
            if status is not None:
                self.scheduler.finish(request, status)
            outputs.append(self.output(request))
        return outputs

    def follow(self, request: Request, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None,
               finish_reason: FinishReason | None = None) -> RequestOutput:
        """Take in tokens of a request generated elsewhere (not in the scheduler):
        its text, stop strings and finish exactly as if sampled here; its delta.

        `finish_reason` ends it for a reason the tokens do not show (the other
        worker's own limits). NOTE: reads only fixed settings, so any thread may call it.
        """
        for i, token in enumerate(token_ids):
            if request.is_finished:
                break  # a stop string ended it here; later tokens are dropped
            request.append_token(token)
            if logprobs:
                request.pending_logprobs.append(logprobs[i])
            status = self.stop_checker.check(request)
            if status is not None:
                request.status = status
        if finish_reason is not None and not request.is_finished:
            if request.detokenizer is not None:
                request.output_text += request.detokenizer.flush()
            request.status = RequestStatus.finished(finish_reason)
        return self.output(request)

    def abort_followed(self, request: Request) -> RequestOutput:
        """End a followed request as aborted; its final delta."""
        request.status = RequestStatus.FINISHED_ABORTED
        return self.output(request)

    def output(self, request: Request) -> RequestOutput:
        """The request's delta since its previous output."""
        new_tokens = request.output_token_ids[request.num_sent_tokens :]
        visible = self.stop_checker.num_visible_chars(request)
        new_text = request.output_text[request.num_sent_chars : visible]
        logprobs = list(request.pending_logprobs) if request.sampling_params.logprobs is not None else None
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent and new_tokens:
            prompt_logprobs, request.prompt_logprobs_sent = list(request.prompt_logprobs), True
        request.num_sent_tokens = request.num_output_tokens
        request.num_sent_chars = max(request.num_sent_chars, visible)
        request.pending_logprobs.clear()
        handed_off = request.status is RequestStatus.HELD
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=request.is_finished or handed_off,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_reason=request.stop_reason,
            handed_off=handed_off,
            held_block_ids=tuple(request.block_table) if handed_off else (),
            scheduled_at=request.first_scheduled_at,
        )

    # --- state --------------------------------------------------------------

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self._finished_between_steps)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def check_integrity(self) -> None:
        """Assert the block pool's invariants (cheap enough to run when idle)."""
        self.block_manager.check_integrity(self.scheduler.requests.values())


class StopChecker:
    """Decides whether a request is done after its newest token, and how much
    of its text may go out now."""

    def __init__(self, eos_token_ids: Set[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, request: Request) -> RequestStatus | None:
        """Take in the newest token: its text, then the stop conditions.
        Returns the finished status, or None to go on."""
        params = request.sampling_params
        token = request.last_token_id
        # Before min_tokens (as vLLM), no stop token, end of sequence or stop string ends it.
        may_stop = request.num_output_tokens >= params.min_tokens
        # Stop and end-of-sequence tokens finish the request without adding text.
        if may_stop and token in params.stop_token_ids:
            request.stop_reason = token
            status: RequestStatus | None = RequestStatus.FINISHED_STOPPED
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        else:
            if request.detokenizer is not None and self._add_text(request, request.detokenizer.add([token]), may_stop):
                return RequestStatus.FINISHED_STOPPED
            too_long = request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len
            status = RequestStatus.FINISHED_LENGTH if too_long else None
        if status is not None and request.detokenizer is not None:
            # Nothing will complete a held-back partial character any more.
            if self._add_text(request, request.detokenizer.flush()):
                return RequestStatus.FINISHED_STOPPED
        return status

    def num_visible_chars(self, request: Request) -> int:
        """Length of the text prefix that may go out: all of it once finished,
        else all but the longest tail that could begin a stop string."""
        text, stops = request.output_text, request.sampling_params.stop
        if request.is_finished or not stops:
            return len(text)
        hold = 0
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return len(text) - hold

    @staticmethod
    def _add_text(request: Request, delta: str, check_stops: bool = True) -> bool:
        """Append text; on a stop string (if checked), cut the text before it and return True."""
        if not delta:
            return False
        old_len = len(request.output_text)
        text = request.output_text + delta
        stops = request.sampling_params.stop if check_stops else ()
        if stops:
            # A match may begin in the held-back tail of the old text.
            start = max(0, old_len - max(len(s) for s in stops) + 1)
            hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
            if hits:
                index, stop = min(hits)
                request.output_text = text[:index]
                request.stop_reason = stop
                return True
        request.output_text = text
        return False
