"""Errors the PD roles raise; the gRPC servicer maps each class to one status code."""

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
