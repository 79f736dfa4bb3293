"""What the client port checks before a request costs anything: the API key,
the body's size, and how many requests the worker already holds; and the body's
shape, once read."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from disagg.workers.http.errors import BodyTimeout, BodyTooLarge, Overloaded, Unauthorized

# Far above any prompt that fits a context (128k tokens as JSON ids is ~1 MB),
# far below what blocks a parse for long (20 MB took seconds).
MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_TIMEOUT_S = 60.0  # a body trickled slower than this holds a connection for nothing (slow loris)
# Requests held per request the engine batches, when --max-queued-requests is unset.
DEFAULT_QUEUE_PER_SEQ = 4
RETRY_AFTER_S = 1

RequestCheck = Callable[[Request], Awaitable[None]]


def bearer_check(api_key: str, on_failure: Callable[[], None]) -> RequestCheck:
    """A route dependency that refuses (401) a request without `Authorization: Bearer <api_key>`,
    calling `on_failure` for each refusal."""
    expected = api_key.encode()

    async def check(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken says nothing about how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            on_failure()
            raise Unauthorized("a valid API key is required: send 'Authorization: Bearer <key>'")

    return check


Body = TypeVar("Body", bound=BaseModel)


def parse_body(kind: type[Body], raw: bytes) -> Body:
    """A body read by read_body, validated as `kind`; FastAPI's validation error (a 400 in
    OpenAI's shape, naming the field) when it does not fit."""
    try:
        return kind.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`: from its
    Content-Length before reading, or while reading a chunked one; 408 when it has
    not all come within `timeout_s`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None
    return b"".join(chunks)


def max_in_flight(max_num_seqs: int, max_queued_requests: int | None) -> int:
    """Client requests (each of an `n > 1` counts n) a worker holds at once."""
    queued = DEFAULT_QUEUE_PER_SEQ * max_num_seqs if max_queued_requests is None else max_queued_requests
    return max_num_seqs + queued


class Admission:
    """A bounded count of the client requests held; beyond it, a 429 with Retry-After."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the admission limit must be at least 1, got {limit}")
        self.limit = limit
        self._held = 0  # only touched on the event loop

    @property
    def held(self) -> int:
        return self._held

    def check_room(self) -> None:
        """Refuse before reading a body when not even one more request fits."""
        if self._held >= self.limit:
            raise Overloaded(self.limit, RETRY_AFTER_S)

    def enter(self, count: int) -> None:
        if self._held + count > self.limit:
            raise Overloaded(self.limit, RETRY_AFTER_S)
        self._held += count

    def leave(self, count: int) -> None:
        self._held -= count

    @contextmanager
    def slot(self, count: int) -> Iterator[None]:
        self.enter(count)
        try:
            yield
        finally:
            self.leave(count)
