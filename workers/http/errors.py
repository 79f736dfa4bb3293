"""OpenAI-shaped errors: `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from disagg.workers.http.protocol import ErrorInfo, ErrorResponse
from disagg.workers.pd import errors as pd_errors

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error to answer with, at the status and OpenAI type it names."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.headers = headers
        self.code = code  # OpenAI's error code where it names one; else the status

    def response(self) -> JSONResponse:
        response = error_response(self.message, self.status, self.type, self.param, self.code)
        response.headers.update(self.headers or {})
        return response


class BadRequest(APIError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, 400, "invalid_request_error", param)


class ContextLengthExceeded(APIError):
    """A prompt (and the tokens asked for) past the model's context: OpenAI's code, and the opening words
    OpenAI and vLLM both use, which clients (LiteLLM's ContextWindowExceededError) match to trim a history."""

    def __init__(self, context: int, prompt_tokens: int, detail: str, param: str) -> None:
        super().__init__(f"This model's maximum context length is {context} tokens. However, the prompt has "
                         f"{prompt_tokens} tokens; {detail}", 400, "invalid_request_error", param,
                         code="context_length_exceeded")


class ModelNotFound(APIError):
    """A request for another model: OpenAI's shape, as NoSuchModel's."""

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model `{model}` does not exist; this server serves `{served}`.", 404,
                         "invalid_request_error", "model", code="model_not_found")


class NoSuchModel(APIError):
    """GET /v1/models/{id} of another model: OpenAI's answer, word for word in shape."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", 404, "invalid_request_error", code="model_not_found")


class NotReady(APIError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"The server is not ready: {reason}", 503, "service_unavailable")


# Each way a prefill fails a client's request answers with exactly one status and type.
ROLE_ERRORS: dict[type[pd_errors.RequestFailed], tuple[int, str]] = {
    pd_errors.NoDecodeAvailable: (503, "service_unavailable"),
    pd_errors.PromptNeverFits: (413, "invalid_request_error"),
    pd_errors.DecodeFailed: (502, "server_error"),
    pd_errors.RequestRefused: (500, "server_error"),
}


def role_api_error(exc: pd_errors.RequestFailed) -> APIError:
    """The HTTP answer to a role's failure."""
    status, kind = next(ROLE_ERRORS[cls] for cls in type(exc).__mro__ if cls in ROLE_ERRORS)
    return APIError(str(exc), status, kind)
class Unauthorized(APIError):
    def __init__(self, message: str) -> None:
        # OpenAI's body for a missing or wrong key.
        super().__init__(message, 401, "invalid_request_error", headers={"WWW-Authenticate": "Bearer"},
                         code="invalid_api_key")


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes", 413, "invalid_request_error")


class BodyTimeout(APIError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s:.0f} s", 408, "invalid_request_error")


class Overloaded(APIError):
    def __init__(self, limit: int, retry_after_s: int) -> None:
        super().__init__(f"the server is at its limit of {limit} requests in flight; retry after {retry_after_s} s",
                         429, "rate_limit_error", headers={"Retry-After": str(retry_after_s)})


def error_response(message: str, status: int, type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, code=status if code is None else code, param=param))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for pydantic's list of problems, plus the first field."""
    parts = []
    param = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            continue
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error, including FastAPI's own 422s, in OpenAI's shape."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return error_response(message, 400, "invalid_request_error", param)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code >= 500:
            kind = "server_error"
        response = error_response(str(exc.detail or HTTPStatus(exc.status_code).phrase), exc.status_code, kind)
        response.headers.update(exc.headers or {})
        return response

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=exc)
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
