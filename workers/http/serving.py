"""Answers /v1/completions and /v1/chat/completions from a backend's
sequence outputs: whole responses, or server-sent events when `stream`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from opentelemetry.util.types import AttributeValue
from pydantic import BaseModel

from disagg.workers import tracing
from disagg.workers.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import Backend
from disagg.workers.http.errors import APIError, BadRequest, role_api_error
from disagg.workers.pd.errors import RequestFailed
from disagg.workers.http.fanout import ClientDisconnected, stream_choices
from disagg.workers.http.logprobs import (
    chat_logprobs,
    completion_logprobs,
    prompt_entries,
    sampled_entries,
    vllm_prompt_logprobs,
)
from disagg.workers.http.prepare import Prepared
from disagg.workers.http.tool_parser import ToolCallParser, parse_output
from disagg.workers.http.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    PromptLogprobs,
    PromptTokensDetails,
    ToolCall,
    UsageInfo,
    now,
)
from disagg.workers.metrics import RequestOutcome, WorkerMetrics

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """What one choice has produced so far, and when."""

    index: int
    prompt_index: int = 0  # which prompt of a batch it continues
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    echoed: bool = False  # streaming: its echoed prompt has gone out
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    served_by: str | None = None

    def add(self, out: RequestOutput, at: float) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.num_output_tokens = out.num_output_tokens
        self.served_by = out.served_by or self.served_by
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.new_token_ids:
            self.first_token_at = self.first_token_at or at
            self.last_token_at = at
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


@dataclass
class Call:
    """One API request on its way through the backend."""

    kind: str  # "completion" or "chat"
    request_id: str
    model_name: str
    prepared: Prepared
    return_token_ids: bool
    include_usage: bool  # streaming only: send a last chunk with usage
    continuous_usage: bool = False  # streaming only: each chunk also carries its choice's usage so far
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` asked for: this many alternatives
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=now)  # every chunk of a stream carries the same, as OpenAI's

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)

    @property
    def wants_logprobs(self) -> bool:
        return self.prepared.params.logprobs is not None

    def new_choices(self) -> list[Choice]:
        n = self.prepared.params.n
        return [Choice(i, i // n) for i in range(n * len(self.prepared.prompts))]

    def usage(self, choices: list[Choice]) -> UsageInfo:
        completion = sum(c.num_output_tokens for c in choices)
        # Each prompt counts once (as vLLM), its cached part as its first choice found it.
        cached = sum(c.num_cached_tokens for c in choices if c.index % self.prepared.params.n == 0)
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            served_by=next((c.served_by for c in choices if c.served_by), None),
        )

    def choice_usage(self, choice: Choice) -> UsageInfo:
        """One choice's usage so far: its prompt and its tokens (vLLM's continuous usage stats)."""
        prompt = len(self.prepared.prompts[choice.prompt_index])
        return UsageInfo(prompt_tokens=prompt, completion_tokens=choice.num_output_tokens,
                         total_tokens=prompt + choice.num_output_tokens)

    def shaped(self, out: RequestOutput) -> RequestOutput:
        """`max_tokens: 0` with echo: the token made to end the prompt's forward is not returned."""
        echo = self.prepared.echo
        if echo is None or not echo.drop_output:
            return out
        finish = FinishReason.LENGTH if out.finished and out.finish_reason is not FinishReason.ABORT else out.finish_reason
        return dataclasses.replace(out, new_token_ids=[], new_text="", new_logprobs=[], num_output_tokens=0,
                                   finish_reason=finish, stop_reason=None)


class OpenAIServing:
    """Runs API calls against one backend and records their metrics."""

    def __init__(self, backend: Backend, metrics: WorkerMetrics) -> None:
        self.backend = backend
        self.metrics = metrics

    @property
    def tokenizer(self) -> Tokenizer:
        return self.backend.tokenizer

    async def outputs(
        self, call: Call, choices: list[Choice], wait_disconnect: Callable[[], Awaitable[None]] | None
    ) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
        """The merged deltas of every choice, with metrics recorded at the end."""
        status = RequestOutcome.ERROR
        p = call.prepared
        try:
            async with aclosing(stream_choices(self.backend, call.request_id, p.prompts, p.params, wait_disconnect)) as stream:
                async for i, out in stream:
                    out = call.shaped(out)
                    choices[i].add(out, time.monotonic())
                    yield choices[i], out
            aborted = any(c.finish_reason is FinishReason.ABORT for c in choices)
            status = RequestOutcome.ABORTED if aborted else RequestOutcome.OK
        except (ClientDisconnected, GeneratorExit, asyncio.CancelledError):
            status = RequestOutcome.ABORTED
            raise
        except ValueError as exc:  # the backend refused the request: the client's mistake
            status = RequestOutcome.REJECTED
            raise BadRequest(str(exc)) from exc
        except RequestFailed as exc:  # a role's failure, at its HTTP status
            error = role_api_error(exc)
            if error.status < 500:  # refused for what it asks (a prompt no decode can hold)
                status = RequestOutcome.REJECTED
            raise error from exc
        finally:
            self._record(call, choices, status)

    def _record(self, call: Call, choices: list[Choice], status: str) -> None:
        end = time.monotonic()
        self.metrics.count_request(status)
        if tracing.is_enabled():
            tracing.annotate(_gen_ai_attributes(call, choices))
        # Only what ran counts tokens and latencies: a request failed before its prompt was computed
        # (no decode had room, say) would add prompt tokens no usage reports and a timeout as a latency.
        ran = [c for c in choices if status == RequestOutcome.OK or c.first_token_at is not None]
        if ran:
            self.metrics.count_prompt_tokens(call.num_prompt_tokens)
        for c in ran:
            ttft = None if c.first_token_at is None else c.first_token_at - call.arrival
            span = 0.0 if c.first_token_at is None or c.last_token_at is None else c.last_token_at - c.first_token_at
            self.metrics.observe_sequence(ttft, end - call.arrival, c.num_output_tokens, span)

    # --- whole responses ------------------------------------------------

    async def respond(self, call: Call, wait_disconnect: Callable[[], Awaitable[None]] | None) -> BaseModel:
        choices = call.new_choices()
        async with aclosing(self.outputs(call, choices, wait_disconnect)) as outputs:
            async for _ in outputs:
                pass
        usage = call.usage(choices)
        if call.kind == "chat":
            return ChatCompletionResponse(
                id=call.request_id, created=call.created, model=call.model_name, usage=usage,
                prompt_logprobs=self._prompt_logprobs(call, choices[0]),
                choices=[
                    ChatChoice(
                        index=c.index,
                        message=message,
                        logprobs=chat_logprobs(self.tokenizer, c.logprobs) if call.wants_logprobs else None,
                        finish_reason=finish,
                        stop_reason=c.stop_reason,
                        token_ids=c.token_ids if call.return_token_ids else None,
                    )
                    for c, (message, finish) in zip(choices, (_chat_answer(call, c) for c in choices))
                ],
            )
        return CompletionResponse(
            id=call.request_id, created=call.created, model=call.model_name, usage=usage,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=self._echo_text(call, c) + c.text,
                    logprobs=self._completion_logprobs(call, c, c.logprobs, 0, echo=True),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if call.return_token_ids else None,
                    prompt_logprobs=self._prompt_logprobs(call, c),
                )
                for c in choices
            ],
        )

    # --- server-sent events ---------------------------------------------

    async def stream(self, call: Call, wait_disconnect: Callable[[], Awaitable[None]] | None) -> AsyncGenerator[str, None]:
        """SSE lines: one chunk per delta, then usage if asked, then [DONE]."""
        choices = call.new_choices()
        tools = call.prepared.tools
        parsers = {c.index: ToolCallParser(tools) for c in choices} if tools is not None else {}
        try:
            if call.kind == "chat":
                # With tools the content may stay null (only calls), as OpenAI streams it.
                content = "" if tools is None else None
                for c in choices:
                    role = self._chat_chunk(call, c, ChatDelta(role="assistant", content=content))
                    yield _sse(self._with_usage(call, c, role))
            async with aclosing(self.outputs(call, choices, wait_disconnect)) as outputs:
                async for choice, out in outputs:
                    if not (out.new_text or out.new_token_ids or out.finished):
                        continue
                    chunk = self._chunk(call, choice, out, parsers.get(choice.index))
                    if chunk is not None:
                        yield _sse(self._with_usage(call, choice, chunk))
            if call.include_usage:
                usage = call.usage(choices)
                kind = ChatCompletionChunk if call.kind == "chat" else CompletionResponse
                yield _sse(kind(id=call.request_id, created=call.created, model=call.model_name, choices=[],
                                usage=usage))
        except ClientDisconnected:
            return
        except APIError as exc:  # the status line is already sent: report in band
            yield _sse(ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.type, code=exc.status)))
        except Exception as exc:
            log.exception("streamed request %s failed", call.request_id)
            info = ErrorInfo(message=f"internal error: {type(exc).__name__}: {exc}", type="server_error", code=500)
            yield _sse(ErrorResponse(error=info))
        yield "data: [DONE]\n\n"

    def _chunk(self, call: Call, choice: Choice, out: RequestOutput, parser: ToolCallParser | None
               ) -> ChatCompletionChunk | CompletionResponse | None:
        """The chunk of one output; None for a chat chunk that would carry nothing (a tool call's
        text held back while it is parsed, without logprobs or token ids asked for), as vLLM skips it."""
        token_ids = out.new_token_ids if call.return_token_ids else None
        finish = out.finish_reason if out.finished else None
        stop_reason = out.stop_reason if out.finished else None
        new_logprobs = out.new_logprobs or []
        if call.kind == "chat":
            delta = ChatDelta(content=out.new_text)
            chat_finish: str | None = finish
            if parser is not None:
                content, tool_calls = parser.feed(out.new_text, final=out.finished)
                delta = ChatDelta(content=content or None, tool_calls=tool_calls or None)
                chat_finish = _finish_reason(finish, parser.calls)
                if not (content or tool_calls or chat_finish or call.wants_logprobs or token_ids is not None):
                    return None
            return self._chat_chunk(
                call, choice, delta,
                logprobs=chat_logprobs(self.tokenizer, new_logprobs) if call.wants_logprobs else None,
                finish_reason=chat_finish, stop_reason=stop_reason, token_ids=token_ids,
            )
        # The first chunk of a choice carries its echoed prompt and vLLM's prompt logprobs.
        first, choice.echoed = not choice.echoed, True
        echo_text = self._echo_text(call, choice)
        offset = len(echo_text) + len(choice.text) - len(out.new_text)  # in the whole text, the echo first
        return CompletionResponse(
            id=call.request_id, created=call.created, model=call.model_name,
            choices=[
                CompletionChoice(
                    index=choice.index, text=(echo_text if first else "") + out.new_text,
                    logprobs=self._completion_logprobs(call, choice, new_logprobs, offset, echo=first),
                    finish_reason=finish, stop_reason=stop_reason, token_ids=token_ids,
                    prompt_logprobs=self._prompt_logprobs(call, choice) if first else None,
                )
            ],
        )

    @staticmethod
    def _with_usage(call: Call, choice: Choice, chunk: ChatCompletionChunk | CompletionResponse
                    ) -> ChatCompletionChunk | CompletionResponse:
        if call.continuous_usage:
            chunk.usage = call.choice_usage(choice)
        return chunk

    @staticmethod
    def _chat_chunk(call: Call, choice: Choice, delta: ChatDelta, **fields: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=call.request_id, created=call.created, model=call.model_name,
            choices=[ChatChunkChoice(index=choice.index, delta=delta, **fields)],  # type: ignore[arg-type]
        )

    # --- echo and logprobs -----------------------------------------------

    @staticmethod
    def _echo_text(call: Call, choice: Choice) -> str:
        echo = call.prepared.echo
        return "" if echo is None else echo.texts[choice.prompt_index]

    def _completion_logprobs(self, call: Call, choice: Choice, logprobs: list[TokenLogprob], text_offset: int,
                             echo: bool) -> CompletionLogprobs | None:
        """`echo`: the echoed prompt's tokens come first, when the request echoes."""
        num_top = call.prepared.params.logprobs
        if num_top is None:
            return None
        entries = sampled_entries(logprobs)
        # An echo with logprobs asked for the prompt's; a choice aborted before its first token has none.
        if echo and call.prepared.echo is not None and choice.prompt_logprobs is not None:
            prompt = call.prepared.prompts[choice.prompt_index]
            entries = prompt_entries(prompt, choice.prompt_logprobs) + entries
            text_offset = 0  # the echoed prompt begins the choice's text
        return completion_logprobs(self.tokenizer, entries, text_offset, num_top)

    def _prompt_logprobs(self, call: Call, choice: Choice) -> PromptLogprobs | None:
        if call.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, choice.prompt_logprobs, call.prompt_logprobs)


def _gen_ai_attributes(call: Call, choices: list[Choice]) -> dict[str, AttributeValue]:
    """The request's span attributes, as OpenTelemetry's gen_ai semantic conventions name them."""
    params = call.prepared.params
    return {
        tracing.GEN_AI_OPERATION: "chat" if call.kind == "chat" else "text_completion",
        tracing.GEN_AI_MODEL: call.model_name, tracing.GEN_AI_RESPONSE_ID: call.request_id,
        tracing.GEN_AI_MAX_TOKENS: params.max_tokens, tracing.GEN_AI_TEMPERATURE: params.temperature,
        tracing.GEN_AI_TOP_P: params.top_p, tracing.GEN_AI_INPUT_TOKENS: call.num_prompt_tokens,
        tracing.GEN_AI_OUTPUT_TOKENS: sum(c.num_output_tokens for c in choices),
        tracing.GEN_AI_FINISH_REASONS: [str(c.finish_reason) for c in choices if c.finish_reason is not None],
    }


def _chat_answer(call: Call, choice: Choice) -> tuple[ChatResponseMessage, str | None]:
    """The choice's message and finish reason: its text, or its content and
    tool calls when tools were offered."""
    if call.prepared.tools is None:
        return ChatResponseMessage(content=choice.text), choice.finish_reason
    content, calls = parse_output(call.prepared.tools, choice.text)
    return ChatResponseMessage(content=content, tool_calls=calls or None), _finish_reason(choice.finish_reason, calls)


def _finish_reason(finish: FinishReason | None, tool_calls: list[ToolCall]) -> str | None:
    """OpenAI's `tool_calls` for a choice that ended by itself after calling tools."""
    return "tool_calls" if finish is FinishReason.STOP and tool_calls else finish


def _sse(body: BaseModel) -> str:
    # pydantic's own serializer: a fifth of the time of model_dump then json.dumps, once per token
    # of every stream; a non-finite float becomes null, which every JSON parser reads.
    return f"data: {body.model_dump_json()}\n\n"
