"""Each way a role fails a client's request answers one HTTP status (http/errors.py)."""

from __future__ import annotations

import pytest

from disagg.workers.http.errors import ROLE_ERRORS, role_api_error
from disagg.workers.pd import errors


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (errors.NoDecodeAvailable("none linked"), 503, "service_unavailable"),
    (errors.PromptNeverFits("too long"), 413, "invalid_request_error"),
    (errors.DecodeFailed("went away"), 502, "server_error"),
    (errors.RequestRefused("refused"), 500, "server_error"),
])
def test_role_errors_map_to_one_status_each(exc: errors.RequestFailed, status: int, kind: str) -> None:
    answer = role_api_error(exc)
    assert (answer.status, answer.type, answer.message) == (status, kind, str(exc))


def test_every_role_error_has_a_status() -> None:
    assert set(errors.RequestFailed.__subclasses__()) == set(ROLE_ERRORS)
