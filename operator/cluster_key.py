"""The cluster key's life: made once per cluster, rotated in steps no worker can miss.

Pure: `plan_key` decides what the cluster's Secret should hold next from
what it holds now, the text the operator last knew, and whether every worker
has taken the current step; controller.py reads and writes the Secret.

The Secret holds one key per line: the first signs, every line is accepted
(`ClusterKey`). Workers mount it, so the kubelet updates their file in place
and no pod restarts. A rotation (the Secret deleted, or replaced by one with
a new key) goes through three contents, each written only once every worker
reports (in /health) the fingerprint of the one before:

    accept:  old, new   everyone learns the new key; all still sign with the old
    sign:    new, old   everyone signs with the new key; the old one still passes
    done:    new        the old key is refused from now on

Two workers at neighbouring steps always accept each other's calls and
handshakes, so no request fails during a rotation. A deleted Secret can only
be staged this way while the operator remembers the old key (it does between
passes; after an operator restart it cannot, and says so: the workers then
need a restart to take the new key).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from disagg.workers.security.key import new_key_text

ACCEPT = "accept"
SIGN = "sign"


@dataclass(frozen=True)
class KeyPlan:
    """What to do with the Secret: `text` (with the rotation step `rotation`) to
    create or write, or nothing when `text` is None; `event` to report."""

    text: str | None = None
    rotation: str | None = None
    create: bool = False
    event: tuple[str, str, str] | None = None  # (type, reason, message)


def every_worker_holds(expected: str, fingerprints: Sequence[str | None]) -> bool:
    """Whether a rotation may take its next step: every running worker answered with the
    fingerprint of the current text. One that did not answer (None: busy past the timeout,
    still starting) holds the step, for a step taken without it would leave it two behind
    and refuse the next signer's calls; a worker that never answers again is restarted by
    its liveness probe and reads the current file when it starts."""
    return all(fp == expected for fp in fingerprints)


def keys_of(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines() if line.strip()]


def plan_key(current: str | None, rotation: str | None, known: str | None, settled: bool) -> KeyPlan:
    """The next step for the Secret.

    Args:
        current: the Secret's key text; None when there is no Secret.
        rotation: its rotation annotation (ACCEPT, SIGN or None).
        known: the key text the operator last saw for this cluster; None after a restart.
        settled: every running worker reports the fingerprint of `current` (`every_worker_holds`).
    """
    fresh = new_key_text().decode()
    if current is None:
        if known is None:
            return KeyPlan(fresh, create=True, event=("Normal", "ClusterKeyCreated", "made the cluster key Secret"))
        return KeyPlan(f"{keys_of(known)[0]}\n{fresh}", ACCEPT, create=True, event=(
            "Normal", "KeyRotationStarted", "the cluster key Secret was deleted: rotating to a new key "
            "(step 1 of 3: every worker accepts it)"))
    keys = keys_of(current)
    if rotation is None and known is not None and keys and keys[0] not in keys_of(known):
        # Replaced by hand with a new key: stage it as a rotation rather than cut off every worker at once.
        return KeyPlan(f"{keys_of(known)[0]}\n{keys[0]}", ACCEPT, event=(
            "Normal", "KeyRotationStarted", "the cluster key Secret holds a new key: rotating to it "
            "(step 1 of 3: every worker accepts it)"))
    if not settled or len(keys) < 2:
        return KeyPlan()
    if rotation == ACCEPT:
        return KeyPlan(f"{keys[1]}\n{keys[0]}", SIGN, event=(
            "Normal", "KeyRotationSigning", "every worker accepts the new key: step 2 of 3, signing with it"))
    if rotation == SIGN:
        return KeyPlan(keys[0], event=("Normal", "KeyRotated", "every worker signs with the new key: "
                                       "the old key is no longer accepted"))
    return KeyPlan()
