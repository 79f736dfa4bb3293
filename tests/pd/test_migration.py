"""Mid-stream migration, in one process over real gRPC and tcp: a prefill and two decodes; the
decode generating a stream is unlinked (or aborts it) mid-way, the prefill moves the stream to
the other decode, and the client gets one uninterrupted stream equal to an undisturbed run,
greedy and seeded, with every block free afterwards."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import jsonschema
import pytest

from disagg.proto import disagg_pd_pb2_grpc
from disagg.workers.config import Role
from disagg.workers.engine.grammar import GrammarKind, build_grammar
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.errors import DecodeFailed, PeerUnavailable
from disagg.workers.security.control import control_channel

GREEDY = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=120, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
# More tokens before the end may come than the continuation may make: its minimum is what is left of it.
MINIMUM = SamplingParams(max_tokens=120, min_tokens=115, temperature=0.0)
PROMPT = [(11 * i) % 200 + 3 for i in range(13)]


@asynccontextmanager
async def trio(pd_pair: Callable[..., Any], kit: Any, model: Any, pd: PDConfig | None = None) -> AsyncIterator[Any]:
    """pd_pair's prefill and decode, and a second decode linked to the same prefill."""
    async with pd_pair(pd=pd) as pair:
        other, config = await kit.start_worker(model, Role.DECODE, pd=pd)
        channel = control_channel(config.instance_name, kit.key)
        try:
            stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)
            assert (await stub.LinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
            await kit.wait_for(lambda: len(pair.prefill.role.router.peers) == 2, "two decodes linked")
            pair.decodes = {pair.decode_config.instance_name: (pair.decode, pair.stub),
                            config.instance_name: (other, stub)}
            yield pair
        finally:
            await channel.close()
            await kit.stop_worker(other)


def free(pair: Any) -> list[int]:
    return [pair.prefill.role.stats().kv_blocks_free] + [d.role.stats().kv_blocks_free
                                                         for d, _ in pair.decodes.values()]


def migrations(pair: Any, reason: str) -> float:
    value = pair.prefill.role._metrics.registry.get_sample_value("disagg_request_migrations_total",
                                                                 {"reason": reason})
    return 0.0 if value is None else float(value)


async def stream_with_a_fault(pair: Any, params: SamplingParams, fault: str, after: int = 10,
                              cached: list[int] | None = None) -> list[int]:
    """Stream one request; after `after` tokens, fail its decode as `fault` says; all tokens
    (and into `cached`, each output's count of cached prompt tokens)."""
    tokens: list[int] = []
    hit = False
    async for out in pair.prefill.role.generate("r", PROMPT, params):
        tokens += out.new_token_ids
        if cached is not None:
            cached.append(out.num_cached_tokens)
        if not hit and len(tokens) >= after:
            hit = True
            [name] = [n for n, (d, _) in pair.decodes.items() if d.role.stats().requests_running]
            decode, stub = pair.decodes[name]
            if fault == "unlink":
                assert (await stub.UnlinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
            else:  # the decode aborts it (its engine dropped the request)
                wire_id = pair.prefill.role.relay._streams["r"].wire_id
                await decode.role._engine.call(lambda e: e.abort_request(wire_id))
    return tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED, MINIMUM], ids=["greedy", "seeded", "min-tokens"])
@pytest.mark.parametrize("fault", ["unlink", "abort"])
async def test_a_failed_decode_hands_the_stream_on_without_a_seam(
        pd_pair: Callable[..., Any], kit: Any, tiny_model_dir: Any, reference_tokens: Callable[..., list[int]],
        params: SamplingParams, fault: str) -> None:
    async with trio(pd_pair, kit, tiny_model_dir) as pair:
        start = free(pair)
        cached: list[int] = []
        tokens = await stream_with_a_fault(pair, params, fault, cached=cached)
        assert tokens == reference_tokens(PROMPT, params)
        assert migrations(pair, "lost" if fault == "unlink" else "aborted") == 1
        # The usage describes the client's prompt, not the continuation's (which holds the tokens sent).
        assert set(cached) == {cached[0]} and cached[0] <= len(PROMPT)
        await kit.wait_for(lambda: sum(d.role.stats().requests_running for d, _ in pair.decodes.values()) == 0,
                           "no decode runs it")
        if fault == "unlink":  # relink the one that was unlinked: it counts its blocks like the others
            for _, stub in pair.decodes.values():
                assert (await stub.LinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        await kit.wait_for(lambda: free(pair) == start, "every block free on all three workers")


async def test_migration_is_bounded(pd_pair: Callable[..., Any], kit: Any, tiny_model_dir: Any) -> None:
    async with trio(pd_pair, kit, tiny_model_dir, PDConfig(max_migrations=0)) as pair:
        with pytest.raises(DecodeFailed, match="moved 0 of at most 0 times"):
            await stream_with_a_fault(pair, GREEDY, "unlink")
        assert migrations(pair, "lost") == 0



async def test_a_constrained_stream_moves_with_its_grammar_state(
        pd_pair: Callable[..., Any], kit: Any, tiny_model_dir: Any, reference_tokens: Callable[..., list[int]]) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{4,8}$"},
                                               "tags": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                        "minItems": 3, "maxItems": 4}},
              "required": ["name", "tags"], "additionalProperties": False}
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, grammar=build_grammar(GrammarKind.JSON_SCHEMA,
                                                                                          schema))
    async with trio(pd_pair, kit, tiny_model_dir) as pair:
        tokens = await stream_with_a_fault(pair, params, "unlink", after=4)
        assert tokens == reference_tokens(PROMPT, params)
        assert migrations(pair, "lost") == 1
        jsonschema.validate(json.loads(pair.prefill.role.tokenizer.decode(tokens)), schema)


async def test_a_decode_lost_before_it_took_the_request_is_replaced(
        pd_pair: Callable[..., Any], kit: Any, tiny_model_dir: Any, reference_tokens: Callable[..., list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode reserved for a request goes away while the prefill still computes its prompt:
    the request starts again on the other decode instead of failing (before: a 502 with the
    other decode idle), and the lost attempt's blocks come back everywhere."""
    async with trio(pd_pair, kit, tiny_model_dir) as pair:
        start = free(pair)
        role = pair.prefill.role
        compute = role._prefill
        lost: list[str] = []

        async def lose_the_decode_first(call: Any, route: Any) -> Any:
            if not lost:
                lost.append(route.decode)
                _, stub = pair.decodes[route.decode]
                assert (await stub.UnlinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
                await kit.wait_for(lambda: route.decode not in role.router.peers, "the prefill sees it gone")
            return await compute(call, route)

        monkeypatch.setattr(role, "_prefill", lose_the_decode_first)
        tokens = [t async for out in role.generate("r", PROMPT, GREEDY) for t in out.new_token_ids]
        assert tokens == reference_tokens(PROMPT, GREEDY)
        assert migrations(pair, "lost") == 1
        [other] = [name for name in pair.decodes if name not in lost]
        assert pair.decodes[other][0].role.stats().requests_running == 0
        _, stub = pair.decodes[lost[0]]
        assert (await stub.LinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        await kit.wait_for(lambda: free(pair) == start, "every block free on all three workers")


async def test_a_stream_whose_last_decode_goes_goes_on_here(
        pd_pair: Callable[..., Any], reference_tokens: Callable[..., list[int]], kit: Any) -> None:
    """The only linked decode is unlinked mid-stream: the prefill generates the rest itself
    (before: a 502), token for token as an undisturbed run."""
    async with pd_pair() as pair:
        start = pair.prefill.role.stats().kv_blocks_free
        tokens: list[int] = []
        async for out in pair.prefill.role.generate("r", PROMPT, GREEDY):
            tokens += out.new_token_ids
            if len(tokens) >= 10 and pair.prefill.role.router.has_live():
                assert (await pair.stub.UnlinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        assert tokens == reference_tokens(PROMPT, GREEDY)
        assert migrations(pair, "lost") == 1
        await kit.wait_for(lambda: pair.prefill.role.stats().kv_blocks_free == start, "the prefill's blocks free")


async def test_a_hand_off_the_decode_fails_moves_to_another_decode(
        pd_pair: Callable[..., Any], kit: Any, tiny_model_dir: Any, reference_tokens: Callable[..., list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill itself sees the decode fail (FirstGeneration answered UNAVAILABLE) before anything
    else noticed: the request moves on as if that decode had gone, and its reservation there is freed."""
    async with trio(pd_pair, kit, tiny_model_dir) as pair:
        start = free(pair)
        clients = pair.prefill.role._clients
        hand_off = clients.first_generation
        failed: list[str] = []

        async def fail_the_first(address: str, first: Any) -> None:
            if not failed:
                failed.append(address)
                raise PeerUnavailable(f"{address} is restarting")
            await hand_off(address, first)

        monkeypatch.setattr(clients, "first_generation", fail_the_first)
        tokens = [t async for out in pair.prefill.role.generate("r", PROMPT, SEEDED) for t in out.new_token_ids]
        assert tokens == reference_tokens(PROMPT, SEEDED)
        assert failed and migrations(pair, "lost") == 1
        await kit.wait_for(lambda: free(pair) == start, "every block free on all three workers")
