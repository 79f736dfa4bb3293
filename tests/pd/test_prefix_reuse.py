"""Decode-side prefix reuse, prefill + decode in one process over real gRPC and tcp: a
conversation's next turn moves only the blocks the decode lacks, with the same tokens as
one engine; a caller that does not ask (an xLLM prefill) gets fresh blocks as before."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from disagg.proto import disagg_pd_pb2 as pb
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.convert import CACHED_BLOCKS_KEY, PREFIX_REUSE_METADATA, request_to_proto
from disagg.workers.pd.messages import NewRequest
from disagg.workers.transfer import Access

BLOCK_SIZE = 4  # pd_pair's engines (conftest.py)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + 11 * salt + n) % 280 + 3 for i in range(n)]


async def collect(pair: Any, req_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in pair.prefill.role.generate(req_id, prompt, GREEDY):
        tokens += out.new_token_ids
    return tokens


def metric(worker: Any, name: str, **labels: str) -> float:
    value = worker.role._metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def moved(pair: Any) -> float:
    """KV bytes that reached the decode (both modes count them there)."""
    return metric(pair.decode, "disagg_kv_transfer_bytes_total", direction="received",
                  peer=pair.prefill_config.instance_name)


def free_blocks(pair: Any) -> tuple[int, int]:
    return pair.prefill.role.stats().kv_blocks_free, pair.decode.role.stats().kv_blocks_free


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_each_turn_moves_only_the_blocks_the_decode_lacks(pd_pair: Callable[..., Any], mode: str,
                                                                reference_tokens: Callable[..., list[int]]) -> None:
    async with pd_pair(mode) as pair:
        start = free_blocks(pair)
        block_bytes = pair.decode.role._engine.block_bytes
        turn = prompt_of(22)  # 5 full blocks and 2 tokens
        out = await collect(pair, "turn-1", turn)
        assert out == reference_tokens(turn, GREEDY)
        # Nothing cached yet: the whole prompt moves.
        assert moved(pair) == 6 * block_bytes
        assert metric(pair.decode, "disagg_kv_transfer_skipped_blocks_total") == 0
        for n, salt in ((2, 1), (3, 2)):
            before_bytes = moved(pair)
            before_skipped = metric(pair.decode, "disagg_kv_transfer_skipped_blocks_total")
            turn = turn + out + prompt_of(7, salt=salt)  # the answer, then the user's next message
            out = await collect(pair, f"turn-{n}", turn)
            assert out == reference_tokens(turn, GREEDY), f"turn {n}"
            skipped = metric(pair.decode, "disagg_kv_transfer_skipped_blocks_total") - before_skipped
            total = -(-len(turn) // BLOCK_SIZE)
            # At least the previous turn's whole prompt blocks were held; what moved is exactly the rest.
            assert skipped >= (len(turn) - len(out) - 7) // BLOCK_SIZE, f"turn {n}: {skipped} blocks skipped"
            assert moved(pair) - before_bytes == (total - skipped) * block_bytes, f"turn {n}"
            assert metric(pair.prefill, "disagg_kv_transfer_skipped_blocks_total") == \
                metric(pair.decode, "disagg_kv_transfer_skipped_blocks_total")
        hits = metric(pair.decode, "disagg_prefix_cache_hits_total", role="decode")
        assert 0 < hits < metric(pair.decode, "disagg_prefix_cache_queries_total", role="decode")
        # Blocks held by the prefix caches count as free (evictable); nothing leaked.
        assert free_blocks(pair) == start
        for role in (pair.prefill.role, pair.decode.role):
            await role._engine.call(lambda e: e.check_integrity())


async def test_reuse_off_moves_every_block(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair("PUSH", pd=PDConfig(prefix_reuse=False)) as pair:
        first = prompt_of(22)
        out = await collect(pair, "a", first)
        second = first + out + prompt_of(7, salt=1)
        await collect(pair, "b", second)
        block_bytes = pair.decode.role._engine.block_bytes
        assert moved(pair) == (6 + -(-len(second) // BLOCK_SIZE)) * block_bytes
        assert metric(pair.decode, "disagg_kv_transfer_skipped_blocks_total") == 0


async def test_only_a_caller_that_asks_shares_cached_blocks_and_it_may_write_only_the_fresh_ones(
        pd_pair: Callable[..., Any]) -> None:
    async with pd_pair("PUSH") as pair:
        warm = prompt_of(22)
        await collect(pair, "warm", warm)  # the decode now holds its 5 full blocks
        start = pair.decode.role.stats().kv_blocks_free

        async def reserve(req_id: str, metadata: tuple[tuple[str, str], ...]) -> tuple[list[int], dict[str, int]]:
            request = NewRequest(req_id, warm + [7, 8, 9], GREEDY, pair.prefill_config.instance_name)
            call = pair.stub.AddNewRequests(pb.DisaggRequests(prefill_name=pair.prefill_config.instance_name,
                                                              reqs=[request_to_proto(request)]),
                                            timeout=10, metadata=metadata)
            answer = await call
            trailing = dict(await call.trailing_metadata())
            return list(answer.resps[0].blocks_ids), json.loads(trailing.get(CACHED_BLOCKS_KEY, "{}"))

        # An xLLM prefill sends no flag: fresh blocks for the whole prompt, and no counts.
        plain, counts = await reserve("plain", ())
        assert counts == {} and len(plain) == 7
        ours, counts = await reserve("ours", PREFIX_REUSE_METADATA)
        assert counts == {"ours": 5} and len(ours) == 7
        assert not set(plain) & set(ours[:5]), "the plain request shares nothing"
        access = pair.decode.role._transport.access
        prefill = pair.prefill_config.instance_name
        assert access.refusal(prefill, Access.WRITE, ours[5:]) is None
        assert access.refusal(prefill, Access.WRITE, ours[:5]) is not None, "shared blocks are never writable"
        for req_id in ("plain", "ours"):  # a FirstGeneration without a token is refused and frees the reservation
            with pytest.raises(grpc.aio.AioRpcError):
                await pair.stub.FirstGeneration(pb.DisaggGenerationsRequests(
                    multi_gens=[pb.DisaggGenerationsRequest(req_id=req_id)]), timeout=10)
        assert access.refusal(prefill, Access.WRITE, ours[5:]) is not None, "the grant ended with the reservation"
        assert pair.decode.role.stats().kv_blocks_free == start
