"""The engine with the hooks the PD roles need, added by extension so that
the engine package itself knows nothing about PD or transfers.

- prefill: a request added with `hand_off` leaves the batch right after its
  first token, keeping its prompt blocks until `release` (its KV may still be
  in flight to, or be read by, the decode); `layer_hook` sees each step's
  schedule and may return the per-layer callback of its forward (PUSH).
- decode: `reserve` allocates a prompt's blocks without scheduling it; once
  its KV is in them, `admit` appends the first token and the request joins
  the running batch as if it had been prefilled here.

Every method runs on the engine thread: `AsyncEngine.call` gets there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from disagg.workers.engine.async_engine import AsyncEngine
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.model_runner import SampledToken
from disagg.workers.engine.outputs import RequestOutput, TokenLogprob
from disagg.workers.engine.request import Request, RequestStatus
from disagg.workers.engine.sampler import skip_draw
from disagg.workers.engine.sampling_params import SamplingParams

HANDOFF = "handoff"  # finish_reason of a prefill request's one output


class OutOfBlocks(RuntimeError):
    """No free blocks for the prompt now (AddNewRequests 404)."""


class PromptTooLarge(RuntimeError):
    """The prompt can never fit this engine (AddNewRequests 413)."""


class PDEngine(LLMEngine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # Set from the event loop before the request's add reaches this thread:
        self.pending_hand_offs: set[str] = set()
        self.pending_admissions: dict[str, tuple[int, TokenLogprob | None]] = {}
        self._hand_offs: set[str] = set()  # live requests that hand off after their first token
        self.handed_off: dict[str, Request] = {}  # prefill: out of the batch, blocks kept
        self.reserved: dict[str, Request] = {}  # decode: blocks allocated, waiting for their KV

    # --- requests -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        admission = self.pending_admissions.pop(request_id, None)
        if admission is not None:
            self.admit(request_id, *admission)
            return
        hand_off = request_id in self.pending_hand_offs
        self.pending_hand_offs.discard(request_id)
        if request_id in self.reserved or request_id in self.handed_off:
            raise ValueError(f"request id {request_id!r} is already in use")
        super().add_request(request_id, prompt_token_ids, params)
        if hand_off:
            self._hand_offs.add(request_id)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Allocate the prompt's blocks; their ids, in prompt order."""
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLarge(f"{len(prompt_token_ids)} prompt tokens; the context holds {self.max_model_len}")
        self.check_request(prompt_token_ids, params)
        if request_id in self.scheduler.requests or request_id in self.reserved or request_id in self.handed_off:
            raise ValueError(f"request id {request_id!r} is already in use")
        detokenizer = self.tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens) if self.tokenizer else None
        request = Request(request_id, prompt_token_ids, params, self.config.block_size, detokenizer,
                          device=self.model_runner.device)  # fmt: skip
        if request.num_blocks > self.block_manager.num_blocks:
            raise PromptTooLarge(f"the prompt needs {request.num_blocks} blocks of {self.block_manager.num_blocks}")
        # NOTE: fresh blocks only: a shared prefix-cache block must never be overwritten by a transfer.
        if not self.block_manager.can_allocate(request, [], request.num_tokens):
            raise OutOfBlocks(f"{request.num_blocks} blocks needed, {self.block_manager.num_free_blocks} free")
        self.block_manager.allocate(request, [], request.num_tokens)
        self.reserved[request_id] = request
        return list(request.block_table)

    def admit(self, request_id: str, token_id: int, logprob: TokenLogprob | None) -> None:
        """A reserved request's KV has arrived: start decoding after `token_id`."""
        request = self.reserved.pop(request_id, None)
        if request is None:
            raise ValueError(f"no reserved request {request_id!r}")
        request.num_computed_tokens = request.num_prompt_tokens
        self.block_manager.commit(request)
        request.append_token(token_id)
        if request.generator is not None and not request.sampling_params.is_greedy:
            skip_draw(request.generator, self.model_config.vocab_size)  # the prefill's draw of token_id
        # The prefill already sent the first token and its text.
        status = self.stop_checker.check(request)
        request.num_sent_tokens = 1
        request.num_sent_chars = self.stop_checker.num_visible_chars(request)
        del logprob  # sent by the prefill with the first token
        request.status = RequestStatus.RUNNING
        self.scheduler.requests[request_id] = request
        self.scheduler.running.append(request)
        if status is not None:
            self.scheduler.finish(request, status)
            self.report_finished(request)

    def release(self, request_id: str) -> bool:
        """Free the blocks of a handed-off request; False if it holds none."""
        request = self.handed_off.pop(request_id, None)
        if request is None:
            return False
        self.block_manager.free(request)
        return True

    def held_block_ids(self, request_id: str) -> list[int]:
        request = self.handed_off.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} holds no handed-off blocks")
        return list(request.block_table)

    def abort_request(self, request_id: str) -> bool:
        self._hand_offs.discard(request_id)
        request = self.reserved.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)
            return True
        return self.release(request_id) or super().abort_request(request_id)

    # --- the loop -------------------------------------------------------------

    def postprocess(self, sampled: list[SampledToken]) -> list[RequestOutput]:
        handing = [t for t in sampled if t.request.request_id in self._hand_offs]
        outputs = super().postprocess([t for t in sampled if t.request.request_id not in self._hand_offs])
        for token in handing:
            outputs.append(self._hand_off(token))
        return outputs

    def _hand_off(self, token: SampledToken) -> RequestOutput:
        request = token.request
        self._hand_offs.discard(request.request_id)
        self.scheduler.running.remove(request)
        del self.scheduler.requests[request.request_id]
        request.append_token(token.token_id)
        request.status = RequestStatus.FINISHED_STOPPED  # out of the batch; blocks kept for release()
        self.handed_off[request.request_id] = request
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[token.token_id], new_text="", finished=True,
            finish_reason=HANDOFF, num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=1,
            num_cached_tokens=request.num_cached_tokens,
            new_logprobs=[token.logprob] if token.logprob is not None else None,
        )  # fmt: skip

    def check_integrity(self) -> None:
        held = [*self.scheduler.running, *self.reserved.values(), *self.handed_off.values()]
        self.block_manager.check_integrity(held)


class PDAsyncEngine(AsyncEngine[PDEngine]):
    """The async engine, with the PD ways into the engine."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 hand_off: bool = False) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """As AsyncEngine.generate; with `hand_off` the stream ends after the first token
        (finish_reason "handoff") and the prompt blocks stay held until `release`."""
        if hand_off:
            self.engine.pending_hand_offs.add(request_id)
        return super().generate(request_id, prompt_token_ids, params)

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, token_id: int,
              logprob: TokenLogprob | None) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Start decoding a reserved request after its first token; stream its later outputs."""
        self.engine.pending_admissions[request_id] = (token_id, logprob)
        return super().generate(request_id, prompt_token_ids, params)
