"""Prefill + decode in one process, real gRPC and tcp on loopback: outputs,
links, faults and bad RPCs."""

from __future__ import annotations

import asyncio
import threading
import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from disagg.proto import disagg_pd_pb2 as pb, disagg_pd_pb2_grpc, xllm_service_pb2_grpc
from disagg.workers.config import Role
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.http.errors import role_api_error
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.convert import SAMPLING_EXTRAS_KEY, request_to_proto
from disagg.workers.pd.errors import DecodeFailed, NoDecodeAvailable
from disagg.workers.pd.messages import FirstToken, NewRequest, TransferMode
from disagg.workers.security.control import control_channel

NUM_KV_BLOCKS = 128  # the pool of every worker of pd_pair (conftest.py)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Lengths around the block size (4): one token, a block minus one, exact blocks, one past.
PROMPT_LENGTHS = (1, 3, 4, 5, 8, 9, 16, 17, 33)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt + n) % 300 + 3 for i in range(n)]


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


async def collect(pair: Any, req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for out in pair.prefill.role.generate(req_id, prompt, params):
        tokens += out.new_token_ids
    return tokens


def free_blocks(pair: Any) -> tuple[int, int]:
    return pair.prefill.role.stats().kv_blocks_free, pair.decode.role.stats().kv_blocks_free


@pytest.mark.parametrize(("mode", "connections"), [("PUSH", 1), ("PUSH", 3), ("PULL", 3)])
async def test_greedy_outputs_equal_one_engine(pd_pair: Callable[..., Any], mode: str, connections: int,
                                               reference_tokens: Callable[..., list[int]]) -> None:
    async with pd_pair(mode, connections=connections) as pair:
        assert pair.decode.role._transport.num_connections == connections  # --kv-connections reaches the link
        for n in PROMPT_LENGTHS:
            got = await collect(pair, f"r{n}", prompt_of(n))
            assert got == reference_tokens(prompt_of(n), GREEDY), f"prompt of {n} tokens"
        # Concurrent requests batch on the decode and still match.
        prompts = [prompt_of(n, salt=1) for n in PROMPT_LENGTHS]
        results = await asyncio.gather(*(collect(pair, f"c{i}", p) for i, p in enumerate(prompts)))
        for p, got in zip(prompts, results):
            assert got == reference_tokens(p, GREEDY)
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "every block is free")


async def test_seeded_sampling_with_min_p_equals_one_engine(pd_pair: Callable[..., Any],
                                                            reference_tokens: Callable[..., list[int]]) -> None:
    # seed and min_p have no DisaggRequest field: they travel as AddNewRequests metadata.
    params = SamplingParams(max_tokens=12, temperature=1.5, min_p=0.02, seed=1234, ignore_eos=True)
    async with pd_pair() as pair:
        for n in (3, 9):
            expected = reference_tokens(prompt_of(n), params)
            assert await collect(pair, f"s{n}", prompt_of(n), params) == expected, f"prompt of {n} tokens"
        # Another seed draws other tokens: the equality above is the seed's doing.
        assert expected != reference_tokens(prompt_of(9), dataclasses.replace(params, seed=4321))
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "every block is free")


async def test_max_tokens_one_and_stop_strings_end_on_the_prefill(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair() as pair:
        assert len(await collect(pair, "one", prompt_of(6), SamplingParams(max_tokens=1, temperature=0.0))) == 1
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "every block is free")


async def test_link_with_a_different_block_size_is_refused(pd_pair: Callable[..., Any], tiny_model_dir: Any,
                                                          kit: Any) -> None:
    async with pd_pair(link=False) as pair:
        other, config = await kit.start_worker(tiny_model_dir, Role.DECODE, block_size=8)
        try:
            channel = control_channel(config.instance_name, kit.key)
            stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LinkInstance(pair.prefill_info.to_proto(), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "block_size" in (err.value.details() or "")
            await channel.close()
        finally:
            await kit.stop_worker(other)
        assert pair.prefill.role.ready() == (False, "no decode instance is linked to this prefill")


async def test_no_linked_decode_is_a_503(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair(link=False) as pair:
        with pytest.raises(NoDecodeAvailable) as err:
            await collect(pair, "x", prompt_of(5))
        assert role_api_error(err.value).status == 503


async def test_link_and_unlink_are_idempotent_and_unlink_drops_the_decodes_requests(pd_pair: Callable[..., Any]) -> None:
    """The decode drops what it ran for the prefill; the prefill, with no decode left, finishes the stream itself."""
    async with pd_pair(max_model_len=512) as pair:
        assert (await pair.stub.LinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        long = SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(collect(pair, "long", prompt_of(20), long))
        await wait_for(lambda: pair.decode.role.stats().requests_running == 1, "the decode generates")
        assert not task.done()
        assert (await pair.stub.UnlinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        assert (await pair.stub.UnlinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        await wait_for(lambda: pair.decode.role.stats().requests_running == 0, "the decode dropped it")
        counted = pair.decode.role._metrics.requests
        await wait_for(lambda: counted.labels(role="decode", status="aborted")._value.get() == 1, "counted as aborted")
        assert counted.labels(role="decode", status="error")._value.get() == 0, "a drop is no error"
        assert len(await asyncio.wait_for(task, 60)) == long.max_tokens
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "every block is free")
        # Linked again, it serves again.
        assert (await pair.stub.LinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        await wait_for(lambda: pair.prefill.role.ready()[0], "relinked")
        assert len(await collect(pair, "again", prompt_of(5))) == GREEDY.max_tokens


async def test_a_decode_that_no_longer_knows_the_prefill_answers_try_another(pd_pair: Callable[..., Any]) -> None:
    """A drain unlinks both sides at once; whichever hears it first, the prefill's next request must
    be sent elsewhere (404), never failed (500). A draining decode answers 404 whether linked or not."""
    async with pd_pair() as pair:
        name = pair.prefill_config.instance_name

        async def admission(req_id: str) -> int:
            req = request_to_proto(NewRequest(req_id, prompt_of(9), GREEDY, name))
            answer = await pair.stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[req]), timeout=5)
            return answer.resps[0].status_code

        pair.decode.role.set_draining(True)
        assert await admission("while-draining") == 404
        pair.decode.role.set_draining(False)
        assert (await pair.stub.UnlinkInstance(pair.prefill_info.to_proto(), timeout=10)).ok
        assert await admission("unlinked") == 404
        assert free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS)


async def test_client_going_away_frees_both_sides(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair() as pair:
        stream = pair.prefill.role.generate("gone", prompt_of(9), SamplingParams(max_tokens=300, temperature=0.0,
                                                                                  ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "the decode freed its blocks")


async def test_a_client_gone_while_a_decode_reserves_leaves_no_reservation(
        pd_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves while AddNewRequests is out: the decode still reserves, and the prefill
    frees it once answered, instead of the decode holding it for its 120 s reservation TTL."""
    async with pd_pair() as pair:
        role = pair.decode.role
        reserve = role.add_requests
        asked = asyncio.Event()

        async def slow_reserve(*args: Any, **kwargs: Any) -> Any:
            answer = await reserve(*args, **kwargs)
            asked.set()
            await asyncio.sleep(0.5)  # reserved, not yet answered: the client leaves meanwhile
            return answer

        monkeypatch.setattr(role, "add_requests", slow_reserve)
        stream = pair.prefill.role.generate("gone", prompt_of(9), GREEDY)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait_for(asked.wait(), 10)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        await wait_for(lambda: role.stats().kv_blocks_free == NUM_KV_BLOCKS and role.stats().requests_waiting == 0,
                       "the decode freed the reservation")
        monkeypatch.setattr(role, "add_requests", reserve)
        assert len(await collect(pair, "after", prompt_of(7))) == GREEDY.max_tokens


async def test_bad_rpcs_get_errors_and_the_decode_keeps_serving(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair("PULL", pd=PDConfig(max_message_bytes=1 << 16)) as pair:
        stub, name = pair.stub, pair.prefill_config.instance_name

        async def code_of(call: Any) -> grpc.StatusCode:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            return err.value.code()

        unknown = pb.DisaggGenerationsRequests(multi_gens=[pb.DisaggGenerationsRequest(
            req_id="nope", tokens=[pb.RemoteToken(token_id=5)], kv_cache_transfer_mode="PUSH")])
        assert await code_of(stub.FirstGeneration(unknown, timeout=5)) == grpc.StatusCode.NOT_FOUND
        assert await code_of(stub.MultiGenerations(unknown, timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
        assert await code_of(stub.SendPullSignal(pb.PullSignal(), timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
        huge = pb.DisaggRequests(prefill_name=name, reqs=[pb.DisaggRequest(req_id="h", prompt_tokens=[1] * 70000)])
        assert await code_of(stub.AddNewRequests(huge, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED

        req = request_to_proto(NewRequest("dup", prompt_of(9), GREEDY, name))
        first = await stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[req]), timeout=5)
        second = await stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[req]), timeout=5)
        assert [first.resps[0].status_code, second.resps[0].status_code] == [200, 500]
        for extras in ("{not json", '{"x": {"seed": "7"}}', '{"x": {"min_p": 3}}', '{"x": {"colour": 1}}'):
            call = stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[req]), timeout=5,
                                       metadata=((SAMPLING_EXTRAS_KEY, extras.replace("x", "dup")),))
            assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT, extras
        too_big = request_to_proto(NewRequest("big", prompt_of(300), GREEDY, name))
        answer = await stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[too_big]), timeout=5)
        assert answer.resps[0].status_code == 413
        # PULL with block ids out of the prefill's range: refused, and the reservation is freed.
        out_of_range = pb.DisaggGenerationsRequests(multi_gens=[pb.DisaggGenerationsRequest(
            req_id="dup", tokens=[pb.RemoteToken(token_id=5)], kv_cache_transfer_mode="PULL",
            addrs=[pair.prefill_info.transfer_address], block_ids=[NUM_KV_BLOCKS + 1, 0, 1])])
        assert await code_of(stub.FirstGeneration(out_of_range, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "the reservation is freed")
        # The decode still serves.
        assert len(await collect(pair, "after", prompt_of(7))) == GREEDY.max_tokens


async def test_each_role_serves_only_its_own_rpcs(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair(link=False) as pair:
        channel = control_channel(pair.prefill_config.instance_name, pair.prefill_config.cluster_key)
        decode_channel = control_channel(pair.decode_config.instance_name, pair.decode_config.cluster_key)
        try:
            prefill = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)

            async def refusal(call: Any) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                return err.value.code(), err.value.details() or ""

            first = pb.DisaggGenerationsRequests(multi_gens=[pb.DisaggGenerationsRequest(
                req_id="x", tokens=[pb.RemoteToken(token_id=5)], kv_cache_transfer_mode="PUSH")])
            for call in (prefill.AddNewRequests(pb.DisaggRequests(prefill_name="p"), timeout=5),
                         prefill.FirstGeneration(first, timeout=5),
                         prefill.LinkInstance(pair.prefill_info.to_proto(), timeout=5)):
                code, details = await refusal(call)
                assert code == grpc.StatusCode.FAILED_PRECONDITION and "prefill instance" in details
            # Unlinking an unknown decode is a no-op on either role.
            assert (await prefill.UnlinkInstance(pair.prefill_info.to_proto(), timeout=5)).ok
            # Generations: the prefill drops an unknown request; a malformed finish reason is refused.
            tokens = xllm_service_pb2_grpc.XllmRpcServiceStub(channel)
            gen = pb.DisaggStreamGeneration(req_id="gone", finished=True,
                                            outputs=[pb.SequenceOutput(token_ids=[5], finish_reason="stop")])
            answer = await tokens.Generations(pb.DisaggStreamGenerations(gens=[gen]), timeout=5)
            assert [s.ok for s in answer.all_status] == [False]
            gen.outputs[0].finish_reason = "handoff"
            code, _ = await refusal(tokens.Generations(pb.DisaggStreamGenerations(gens=[gen]), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            mismatched = pb.DisaggStreamGeneration(req_id="gone", outputs=[pb.SequenceOutput(
                token_ids=[5, 6], logprobs=[pb.LogProb(log_prob_data=pb.LogProbData(token_id=5, logprob=-1.0))])])
            code, details = await refusal(tokens.Generations(pb.DisaggStreamGenerations(gens=[mismatched]), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "1 logprobs for 2 tokens" in details
            # Token ids outside the vocabulary fail the stream; the client never sees them.
            stream = pair.prefill.role.relay.open("followed", prompt_of(5), GREEDY)
            for bad in (-5, 2**31 - 1):
                gen = pb.DisaggStreamGeneration(req_id="followed", outputs=[pb.SequenceOutput(token_ids=[bad])])
                answer = await tokens.Generations(pb.DisaggStreamGenerations(gens=[gen]), timeout=5)
                assert [s.ok for s in answer.all_status] == [False]
            with pytest.raises(DecodeFailed, match="outside the vocabulary"):
                async for out in stream.outputs():
                    assert not out.new_token_ids
            pair.prefill.role.relay.close("followed")
            # A decode does not serve XllmRpcService at all.
            to_decode = xllm_service_pb2_grpc.XllmRpcServiceStub(decode_channel)
            code, _ = await refusal(to_decode.Generations(pb.DisaggStreamGenerations(gens=[gen]), timeout=5))
            assert code == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await channel.close()
            await decode_channel.close()


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_the_hand_off_does_not_wait_for_the_prefill_engine(pd_pair: Callable[..., Any], mode: str,
                                                                 reference_tokens: Callable[..., list[int]]) -> None:
    """Once a prompt's first token is out, the decode takes over even while the prefill's
    engine is busy with its next step (engine calls wait for a step's end: under load, a
    whole prefill of other prompts)."""
    async with pd_pair(mode) as pair:
        engine = pair.prefill.role._engine
        gate = threading.Event()
        busy: asyncio.Future[bool] | None = None
        tokens: list[int] = []

        async def stream() -> None:
            nonlocal busy
            async for out in pair.prefill.role.generate("r", prompt_of(9), GREEDY):
                tokens.extend(out.new_token_ids)
                if busy is None:  # the first token: hold the prefill's engine thread from now on
                    busy = asyncio.ensure_future(engine.call(lambda e: gate.wait(30)))

        try:
            await asyncio.wait_for(stream(), 20)
            assert not gate.is_set()
            assert tokens == reference_tokens(prompt_of(9), GREEDY), "every token came while the engine was held"
        finally:
            gate.set()
        assert busy is not None and await busy
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "every block is free")


async def test_callers_that_give_up_leave_no_blocks_held(pd_pair: Callable[..., Any]) -> None:
    """An AddNewRequests whose deadline runs out while the decode's engine is busy, and a PULL
    FirstGeneration whose deadline runs out mid-pull: nothing else would ever free their blocks."""
    async with pd_pair("PULL") as pair:
        stub, name, decode = pair.stub, pair.prefill_config.instance_name, pair.decode.role
        req = request_to_proto(NewRequest("late", prompt_of(9), GREEDY, name))
        busy = asyncio.ensure_future(decode._engine.call(lambda e: threading.Event().wait(1.0)))  # a long step
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[req]), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await busy
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "the abandoned reservation is freed")
        answer = await stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[req]), timeout=5)
        assert answer.resps[0].status_code == 200  # the id is free again, too

        session = decode.peers.get(name)
        real_pull = session.pull

        def slow_pull(src: Any, dst: Any) -> Any:  # a slow network: the bytes arrive after the caller gave up
            handle = real_pull(src, dst)
            real_wait = handle.wait
            handle.wait = lambda timeout: (threading.Event().wait(1.0), real_wait(timeout))
            return handle

        session.pull = slow_pull
        first = pb.DisaggGenerationsRequests(multi_gens=[pb.DisaggGenerationsRequest(
            req_id="late", tokens=[pb.RemoteToken(token_id=5)], kv_cache_transfer_mode="PULL",
            addrs=[pair.prefill_info.transfer_address], block_ids=list(answer.resps[0].blocks_ids))])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FirstGeneration(first, timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS) and not decode._incoming,
                       "the request whose pull was abandoned is freed")
        session.pull = real_pull
        assert len(await collect(pair, "after", prompt_of(7))) == GREEDY.max_tokens


async def test_first_generation_takes_each_request_on_its_own(pd_pair: Callable[..., Any]) -> None:
    """One unknown request among several neither stops the others nor strands their blocks."""
    async with pd_pair() as pair:
        stub, name, decode = pair.stub, pair.prefill_config.instance_name, pair.decode.role
        reqs = [request_to_proto(NewRequest(f"m{i}", prompt_of(9, i), GREEDY, name)) for i in range(2)]
        answer = await stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=reqs), timeout=5)
        assert [r.status_code for r in answer.resps] == [200, 200]
        # Streams the prefill does not follow: the decode ends each at its first Generations answer.
        first = pb.DisaggGenerationsRequests(multi_gens=[
            pb.DisaggGenerationsRequest(req_id=req_id, tokens=[pb.RemoteToken(token_id=5)],
                                        kv_cache_transfer_mode="PUSH") for req_id in ("m0", "nope", "m1")])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FirstGeneration(first, timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in (err.value.details() or "")
        assert "m1" not in decode._incoming or decode._incoming["m1"].started  # taken, not left to the sweep
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS) and not decode._incoming,
                       "both requests ran and freed their blocks")


async def test_unlink_needs_only_the_instance_name(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair() as pair:
        name_only = pb.InstanceClusterInfo(instance_name=pair.prefill_config.instance_name)
        assert (await pair.stub.UnlinkInstance(name_only, timeout=5)).ok
        assert not pair.decode.role.peers.is_live(pair.prefill_config.instance_name)
        assert (await pair.stub.UnlinkInstance(pb.InstanceClusterInfo(instance_name="10.9.9.9:1"), timeout=5)).ok
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a link still needs the transfer endpoint
            await pair.stub.LinkInstance(name_only, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_handed_off_request_counts_as_ok_on_the_decode(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair() as pair:
        assert len(await collect(pair, "counted", prompt_of(9))) == GREEDY.max_tokens

        def outcomes(worker: Any) -> dict[str, float | None]:
            registry, role = worker.role._metrics.registry, worker.role._metrics.role
            return {status: registry.get_sample_value("disagg_requests_total", {"role": role, "status": status})
                    for status in ("ok", "aborted")}

        await wait_for(lambda: outcomes(pair.decode)["ok"] == 1.0, "the decode counts its request ok")
        assert not outcomes(pair.decode)["aborted"]


async def test_a_decode_whose_engine_stopped_answers_unavailable(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair() as pair:
        name = pair.prefill_config.instance_name
        assert pair.decode.role._engine.shutdown()
        req = request_to_proto(NewRequest("late", prompt_of(9), GREEDY, name))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.stub.AddNewRequests(pb.DisaggRequests(prefill_name=name, reqs=[req]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not running" in (err.value.details() or "")


async def test_a_request_dropped_before_its_stream_ran_frees_its_blocks(pd_pair: Callable[..., Any]) -> None:
    """A link lost in the same tick as a FirstGeneration: the stream's task is cancelled before it
    ever admitted the request, so only the drop's abort can free the reserved blocks."""
    async with pd_pair() as pair:
        name, decode = pair.prefill_config.instance_name, pair.decode.role
        [reservation] = await decode.add_requests(name, [NewRequest("early", prompt_of(9), GREEDY, name)])
        assert reservation.block_ids and free_blocks(pair)[1] < NUM_KV_BLOCKS
        await decode.first_generation(FirstToken("early", 5, None, TransferMode.PUSH))
        await decode._drop("early", "its prefill went away")  # no await ran the task in between
        await wait_for(lambda: free_blocks(pair) == (NUM_KV_BLOCKS, NUM_KV_BLOCKS), "the reserved blocks are freed")
