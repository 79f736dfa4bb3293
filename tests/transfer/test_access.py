"""Grants of local blocks to peers (`BlockAccess`), checked on every frame by the transport."""

from __future__ import annotations

from disagg.workers.transfer import Access, BlockAccess


def test_a_block_stays_granted_while_any_request_holds_it() -> None:
    refused: list[None] = []
    access = BlockAccess(on_refused=lambda: refused.append(None))
    access.allow("decode-a", "r1", [1, 2, 3], Access.READ)
    access.allow("decode-a", "r2", [3, 4], Access.READ)  # block 3: a prefix shared by both requests
    assert access.refusal("decode-a", Access.READ, [1, 3, 4]) is None
    assert access.refusal("decode-a", Access.WRITE, [1]) is not None, "a read grant does not allow writes"
    assert access.refusal("decode-b", Access.READ, [1]) is not None, "nor another peer"
    access.revoke("r1")
    access.revoke("r1")  # idempotent
    assert access.refusal("decode-a", Access.READ, [3, 4]) is None
    assert access.refusal("decode-a", Access.READ, [2]) == "read of 1 blocks not granted to decode-a"
    access.allow("decode-a", "r2", [5], Access.READ)  # a new grant for r2 replaces its old one
    assert access.refusal("decode-a", Access.READ, [3]) is not None
    access.revoke("r2")
    assert access.granted() == 0 and len(refused) == 4


def test_an_unenforced_table_lets_every_block_through() -> None:
    assert BlockAccess(enforce=False).refusal("anyone", Access.WRITE, [0, 1]) is None
