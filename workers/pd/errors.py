"""Errors the PD roles raise: `PDError`s answer RPCs (the gRPC servicer maps each
class to one status code); `RequestFailed`s end client requests (mapped to HTTP
in `http/errors.py`)."""

from __future__ import annotations


class PDError(Exception):
    """Base of every error a role answers an RPC with."""


class InvalidMessage(PDError):
    """The message is malformed or inconsistent (INVALID_ARGUMENT)."""


class UnknownRequest(PDError):
    """No request with that id is waiting here (NOT_FOUND)."""


class WrongRole(PDError):
    """This RPC belongs to the other role, or to a mode we do not run (FAILED_PRECONDITION)."""


class LinkRefused(PDError):
    """The peer refused the link, e.g. its KV layout differs (FAILED_PRECONDITION)."""


class PeerUnavailable(PDError):
    """A peer or the data path to it failed (UNAVAILABLE)."""


class PeerTimeout(PDError):
    """A bounded wait on a peer or a transfer ran out (DEADLINE_EXCEEDED)."""


# --- why a client's request failed on the prefill (the HTTP edge maps each to a status) ---


class RequestFailed(Exception):
    """Base of the errors that end a client's request on a prefill."""


class NoDecodeAvailable(RequestFailed):
    """No linked decode, or none had free blocks within the bound: try again later."""


class PromptNeverFits(RequestFailed):
    """The prompt can never fit a decode's KV cache."""


class DecodeFailed(RequestFailed):
    """The decode side failed or went away while the request was on it."""


class RequestRefused(RequestFailed):
    """The request could not be run: a decode refused it, or the local engine ended it."""
