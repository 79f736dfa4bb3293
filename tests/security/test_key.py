"""The cluster key ring: the first key signs, every key is accepted, a key file is followed."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from disagg.workers.security import key as key_module
from disagg.workers.security.control import AuthInterceptor, ControlGuard
from disagg.workers.security.key import AuthError, ClusterKey, CredentialVerifier, new_key_text

METHOD = "/xllm.proto.DisaggPDService/LinkInstance"


def _ring(*keys: bytes) -> ClusterKey:
    return ClusterKey(b"\n".join(keys))


def _write(path: Path, *keys: bytes) -> None:
    """Replace the file at once, as the kubelet swaps a Secret volume's files."""
    staged = path.with_suffix(".new")
    staged.write_bytes(b"\n".join(keys) + b"\n")
    os.replace(staged, path)


def test_each_rotation_step_understands_its_neighbours() -> None:
    old, new = new_key_text(), new_key_text()
    steps = [_ring(old), _ring(old, new), _ring(new, old), _ring(new)]
    for signer, checker in [*zip(steps, steps[1:]), *zip(steps[1:], steps)]:
        CredentialVerifier(checker).verify(METHOD, signer.credential(METHOD))
        checker.check_proof(signer.proof("initiator", "a", "b"), "initiator", "a", "b")
    # Two steps apart, the first and the last do not: that is why the operator waits for every worker.
    with pytest.raises(AuthError):
        CredentialVerifier(steps[3]).verify(METHOD, steps[0].credential(METHOD))
    with pytest.raises(AuthError):
        steps[0].check_proof(steps[3].proof("acceptor", "x"), "acceptor", "x")


def test_a_key_file_is_followed_and_a_bad_rewrite_keeps_the_working_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(key_module, "RELOAD_CHECK_S", 0.0)
    old, new = new_key_text(), new_key_text()
    path = tmp_path / "key"
    _write(path, old)
    ring = ClusterKey.from_file(path)
    first = ring.fingerprint()
    assert old.decode() not in first and "," not in first
    _write(path, old, new)
    CredentialVerifier(_ring(new)).verify(METHOD, _ring(new).credential(METHOD))
    CredentialVerifier(ring).verify(METHOD, _ring(new).credential(METHOD))  # the new key is accepted now
    assert ring.fingerprint() == _ring(old, new).fingerprint() != first
    _write(path, b"short")  # not a key: ignored, the previous keys stay
    with caplog.at_level(logging.WARNING, logger=key_module.__name__):
        for _ in range(3):
            assert ring.fingerprint() == _ring(old, new).fingerprint()
    assert len([r for r in caplog.records if "unusable" in r.message]) == 1, "told once, not at every look"
    path.unlink()  # a vanished file changes nothing either
    assert ring.fingerprint() == _ring(old, new).fingerprint()


def test_a_key_file_is_looked_at_no_more_than_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "key"
    _write(path, new_key_text())
    ring = ClusterKey.from_file(path)
    before = ring.fingerprint()
    _write(path, new_key_text())
    assert ring.fingerprint() == before
    time.sleep(key_module.RELOAD_CHECK_S + 0.05)
    assert ring.fingerprint() != before


def test_replace_and_bad_text() -> None:
    ring = _ring(new_key_text())
    nxt = new_key_text()
    ring.replace(nxt + b"\n")
    assert ring.fingerprint() == _ring(nxt).fingerprint()
    for text in (b"", b"\n\n", b"tooshort", b"x" * (key_module.MAX_KEY_BYTES + 1)):
        with pytest.raises(ValueError):
            ring.replace(text)
    assert ring.fingerprint() == _ring(nxt).fingerprint()
    assert "hidden" in repr(ring) and nxt.decode() not in repr(ring)


def test_the_client_ports_guard_refuses_anonymous_calls_and_remembers_credentials_with_the_admin_guard() -> None:
    key = ClusterKey.generate()
    refused: list[str] = []
    admin = ControlGuard(key, allow_anonymous=True, on_failure=refused.append)
    client = admin.refusing_anonymous()
    assert admin.allows(METHOD, None, "http-link"), "an xLLM peer on the admin port"
    assert not client.allows(METHOD, None, "http-link"), "a stranger on the client port"
    credential = key.credential(METHOD)
    assert client.allows(METHOD, credential, "http-link")
    assert not admin.allows(METHOD, credential, "http-link"), "a credential used on one port is spent on both"
    assert refused == ["http-link", "http-link"] and admin.allow_anonymous


def test_proofs_and_names_a_stranger_sends_are_judged_never_raised() -> None:
    """A lone surrogate (JSON's "\\ud800") in a handshake's name or proof encodes to no UTF-8:
    it once raised out of the handshake thread."""
    key = ClusterKey(new_key_text())
    bound = ("n1", "n2", "\ud800", "prefill", "session", "0")
    proof = key.proof("initiator", *bound)
    assert key.matches(proof, "handshake", "initiator", *bound)
    assert not key.matches("\ud800", "handshake", "initiator", *bound)
    with pytest.raises(AuthError):
        key.check_proof("\ud800" * 64, "initiator", *bound)


async def test_a_refused_call_is_answered_without_taking_its_body_in() -> None:
    """A unary handler receives the whole message (up to the 16 MiB limit) before it runs: unsigned
    calls of that size grew a worker by gigabytes. The refusal is a client-streaming handler
    (the same on the wire to a unary caller) that aborts without reading a message."""
    import grpc

    class Details:
        method = "/xllm.proto.DisaggPDService/AddNewRequests"
        invocation_metadata = ()

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise Aborted(code, details)

    async def never_called(details: object) -> grpc.RpcMethodHandler:
        raise AssertionError("a refused call reached the service")

    async def unread_body() -> object:
        raise AssertionError("the refused call's body was read")
        yield  # an async generator: iterating it reads the body

    refused: list[str] = []
    guard = ControlGuard(ClusterKey.generate(), on_failure=refused.append)
    handler = await AuthInterceptor(guard).intercept_service(never_called, Details())  # type: ignore[arg-type]
    assert handler.request_streaming and not handler.response_streaming and handler.stream_unary is not None
    with pytest.raises(Aborted) as aborted:
        await handler.stream_unary(unread_body(), Context())
    assert aborted.value.args[0] is grpc.StatusCode.UNAUTHENTICATED and refused == ["grpc"]

