"""Who may call a keyed prefill/decode pair, and hostile input on its gRPC edge.

Real workers on loopback (the `pd_pair` fixture, keyed with `kit.key`); the
rogue is a client with no key or another one, over real sockets.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest
import torch

from disagg.proto import disagg_pd_pb2 as pb, disagg_pd_pb2_grpc, xllm_service_pb2_grpc
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.convert import request_to_proto
from disagg.proto.vocabulary import DESCRIBE_METHOD, InstanceInfo
from disagg.workers.pd.messages import NewRequest
from disagg.workers.security.control import METADATA_KEY, control_channel
from disagg.workers.security.key import ClusterKey
from disagg.workers.transfer import LinkRefusedError, TransferError, create_transport

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 13, 17, 21, 25]
ADD = "/xllm.proto.DisaggPDService/AddNewRequests"


def _free(pair: Any) -> tuple[int, int]:
    return pair.prefill.role.stats().kv_blocks_free, pair.decode.role.stats().kv_blocks_free


def _failures(pair: Any, path: str) -> float:
    total = 0.0
    for worker in (pair.prefill, pair.decode):
        total += worker.role._metrics.auth_failures.labels(path=path)._value.get()
    return total


def _requests(prefill_name: str, **params: Any) -> pb.DisaggRequests:
    req = NewRequest(f"rogue-{uuid.uuid4().hex[:6]}", PROMPT, SamplingParams(**params) if params else GREEDY, "")
    return pb.DisaggRequests(prefill_name=prefill_name, reqs=[request_to_proto(req)])


async def _serves(pair: Any) -> None:
    tokens = [t async for out in pair.prefill.role.generate(uuid.uuid4().hex, PROMPT, GREEDY) for t in out.new_token_ids]
    assert len(tokens) == GREEDY.max_tokens


async def test_a_caller_without_the_key_is_refused_everywhere(pd_pair: Callable[..., Any], kit: Any) -> None:
    async with pd_pair() as pair:
        before = _free(pair)
        prefill_name = pair.prefill_config.instance_name
        for key in (None, ClusterKey.generate()):
            async with control_channel(pair.decode_config.instance_name, key) as decode, \
                    control_channel(prefill_name, key) as prefill:
                stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(decode)
                calls = [
                    stub.LinkInstance(InstanceInfo("127.0.0.1:1", "127.0.0.1:2").to_proto(), timeout=10),
                    stub.AddNewRequests(_requests(prefill_name), timeout=10),
                    stub.FirstGeneration(pb.DisaggGenerationsRequests(multi_gens=[pb.DisaggGenerationsRequest(
                        req_id="x", tokens=[pb.RemoteToken(token_id=1)])]), timeout=10),
                    disagg_pd_pb2_grpc.DisaggPDServiceStub(prefill).UnlinkInstance(
                        InstanceInfo(pair.decode_config.instance_name, "127.0.0.1:2").to_proto(), timeout=10),
                    xllm_service_pb2_grpc.XllmRpcServiceStub(prefill).Generations(
                        pb.DisaggStreamGenerations(), timeout=10),
                    _describe(prefill)(pb.InstanceClusterInfo(), timeout=10),
                ]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _failures(pair, "grpc") == 12
        assert _free(pair) == before, "no refused call reserved or freed a block"
        assert pair.prefill.role.ready()[0], "the link survived"
        await _serves(pair)


def _describe(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(DESCRIBE_METHOD, request_serializer=pb.InstanceClusterInfo.SerializeToString,
                               response_deserializer=pb.InstanceClusterInfo.FromString)


async def test_a_keyed_caller_learns_a_workers_own_info(pd_pair: Callable[..., Any], kit: Any) -> None:
    """What `disagg link` asks a prefill so that only gRPC addresses need be given."""
    async with pd_pair() as pair:
        for worker, config in ((pair.prefill, pair.prefill_config), (pair.decode, pair.decode_config)):
            async with control_channel(config.instance_name, kit.key) as channel:
                info = InstanceInfo.from_proto(await _describe(channel)(pb.InstanceClusterInfo(), timeout=10))
            assert info == worker.identity and info.name == config.instance_name
        host, _, port = pair.prefill.identity.transfer_address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10):
            pass  # the prefill's data path listens where it says


async def test_a_keyed_caller_sending_bytes_that_are_no_message_gets_invalid_argument(
        pd_pair: Callable[..., Any], kit: Any) -> None:
    """gRPC answered UNKNOWN ("Unexpected <class DecodeError>") with a traceback in the log per call."""
    async with pd_pair() as pair:
        calls = [(pair.decode_config, "/xllm.proto.DisaggPDService/LinkInstance"),
                 (pair.decode_config, "/xllm.proto.DisaggPDService/UnlinkInstance"),
                 (pair.decode_config, ADD), (pair.prefill_config, DESCRIBE_METHOD),
                 (pair.prefill_config, "/xllm_service.proto.XllmRpcService/Generations")]
        for config, method in calls:
            async with control_channel(config.instance_name, kit.key) as channel:
                for garbage in (b"\xff\xff\xff\xff", b"\x0a\x10short"):  # no field; a string cut short
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await channel.unary_unary(method)(garbage, timeout=10)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value)
                    assert f"the {method} request is not a valid message" in (err.value.details() or "")
        assert pair.prefill.role.ready()[0], "the link survived"
        await _serves(pair)


async def test_a_credential_is_good_once_and_only_within_the_window(pd_pair: Callable[..., Any], kit: Any) -> None:
    async with pd_pair() as pair:
        async with control_channel(pair.decode_config.instance_name, None) as channel:
            stub = disagg_pd_pb2_grpc.DisaggPDServiceStub(channel)
            prefill_name = pair.prefill_config.instance_name
            credential = kit.key.credential(ADD)
            answer = await stub.AddNewRequests(_requests(prefill_name), metadata=((METADATA_KEY, credential),),
                                               timeout=10)
            assert len(answer.resps) == 1
            stale = kit.key.credential(ADD, now=time.time() - 120)
            other_method = kit.key.credential("/xllm.proto.DisaggPDService/LinkInstance")
            for bad in (credential, stale, other_method):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.AddNewRequests(_requests(prefill_name), metadata=((METADATA_KEY, bad),), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _failures(pair, "grpc") == 3


async def test_the_http_link_routes_need_the_credential(pd_pair: Callable[..., Any]) -> None:
    """xLLM's HTTP link form, served by the role's app, refuses an unsigned call (401)."""
    from fastapi import FastAPI

    from disagg.workers.pd.service import add_link_routes
    from disagg.workers.security.control import ControlGuard, http_credential_headers

    async with pd_pair() as pair:
        app = FastAPI()
        refused: list[str] = []
        add_link_routes(app, lambda: pair.decode.handlers, ControlGuard(pair.decode_config.cluster_key,
                                                                     on_failure=refused.append))
        path = "/xllm.proto.DisaggPDService/LinkInstance"
        body = {"instance_name": pair.prefill_config.instance_name, "addrs": [pair.prefill_info.transfer_address]}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
            assert (await client.post(path, json=body)).status_code == 401
            wrong = http_credential_headers(ClusterKey.generate(), path)
            assert (await client.post(path, json=body, headers=wrong)).status_code == 401
            signed = http_credential_headers(pair.decode_config.cluster_key, path)
            assert (await client.post(path, json=body, headers=signed)).json() == {"ok": True}
        assert refused == ["http-link", "http-link"]


async def test_a_rogue_transfer_peer_cannot_link(pd_pair: Callable[..., Any], kit: Any) -> None:
    """A handshake without the key gets nothing but "authentication failed", even under the decode's name."""
    async with pd_pair() as pair:
        before = _free(pair)
        pool = pair.decode.role._transport.pool
        for key in (None, ClusterKey.generate()):
            rogue = create_transport("tcp", pool.clone(), pair.decode.role._transport.layout,
                                     pair.decode_config.instance_name, pair.decode_config.instance_name,
                                     num_connections=1, key=key)
            try:
                with pytest.raises(LinkRefusedError, match="authentication failed") as err:
                    rogue.connect(pair.prefill_info.transfer_address, timeout=10)
                assert "layout" not in str(err.value)
            finally:
                rogue.close()
        assert _failures(pair, "transfer") == 2
        assert pair.prefill.role.ready()[0], "the real decode's link survived"
        assert _free(pair) == before
        await _serves(pair)


async def test_bad_link_calls_are_invalid_arguments(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair(link=False) as pair:
        bad_port = pb.InstanceClusterInfo(instance_name="127.0.0.1:5", addrs=["127.0.0.1:99999"])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.stub.LinkInstance(bad_port, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "99999" in str(err.value.details())
        me = pair.decode_config
        itself = InstanceInfo(me.instance_name, f"127.0.0.1:{me.transfer_port}").to_proto()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.stub.LinkInstance(itself, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "itself" in str(err.value.details())
        # A link names an instance: the prefill's transfer port under another name is refused.
        alias = InstanceInfo("127.0.0.1:1", pair.prefill_info.transfer_address).to_proto()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.stub.LinkInstance(alias, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not the" in str(err.value.details())


async def test_hostile_values_fail_alone_before_the_engine(pd_pair: Callable[..., Any]) -> None:
    async with pd_pair() as pair:
        before = _free(pair)
        prefill_name = pair.prefill_config.instance_name
        for hostile in (dict(stop_token_ids=[-1]), dict(top_k=1 << 40)):
            msg = _requests(prefill_name)
            for field, value in hostile.items():
                if isinstance(value, list):
                    getattr(msg.reqs[0], field).extend(value)
                else:
                    setattr(msg.reqs[0], field, value)
            answer = await pair.stub.AddNewRequests(msg, timeout=10)
            assert answer.resps[0].status_code == 500, hostile  # refused, alone
        # An out-of-vocabulary first token is refused, and frees the reservation it names.
        answer = await pair.stub.AddNewRequests(_requests(prefill_name), timeout=10)
        req_id = answer.resps[0].req_id
        assert _free(pair)[1] < before[1]
        first = pb.DisaggGenerationsRequest(req_id=req_id, tokens=[pb.RemoteToken(token_id=10**9)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.stub.FirstGeneration(pb.DisaggGenerationsRequests(multi_gens=[first]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in str(err.value.details())
        assert _free(pair) == before
        await _serves(pair)


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_a_linked_peer_touches_only_the_blocks_of_its_own_requests(pd_pair: Callable[..., Any], mode: str) -> None:
    """Even with the key, a WRITE or READ outside the blocks of the peer's own requests is refused."""
    async with pd_pair(mode) as pair:
        await _serves(pair)  # grants come and go with a request...
        transports = (pair.prefill.role._transport, pair.decode.role._transport)
        deadline = time.monotonic() + 10
        while any(t.access.granted() for t in transports) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert [t.access.granted() for t in transports] == [0, 0], "...and none outlives it"
        before = _free(pair)
        transports[0].pool[:, 7] = 3.0  # a free prefill block with a mark the decode's block 9 lacks
        kept = transports[1].pool[:, 9].clone()
        to_decode = pair.prefill.role.router.peers.get(pair.decode_config.instance_name)
        to_prefill = pair.decode.role.peers.get(pair.prefill_config.instance_name)
        attempts = [lambda: to_decode.push(0, [7], [9]), lambda: to_prefill.pull([7], [9]),
                    lambda: to_decode.pull([9], [7]), lambda: to_prefill.push(0, [9], [7])]
        for attempt in attempts:
            with pytest.raises(TransferError, match="not granted"):
                await asyncio.to_thread(attempt().wait, 10)
        assert torch.equal(transports[1].pool[:, 9], kept) and not torch.equal(kept, transports[0].pool[:, 7])
        assert _failures(pair, "transfer") == 4
        assert to_decode.is_open and to_prefill.is_open, "a refused frame fails alone, not the link"
        assert _free(pair) == before
        await _serves(pair)


async def test_a_decode_takes_kv_only_on_the_links_it_opened(pd_pair: Callable[..., Any], kit: Any) -> None:
    """Even with the key, a peer posing as the decode's prefill cannot open a data path into the decode."""
    async with pd_pair() as pair:
        transport = pair.decode.role._transport
        impostor = create_transport("tcp", transport.pool.clone(), transport.layout,
                                    pair.prefill_config.instance_name, pair.prefill_config.instance_name,
                                    num_connections=1, key=kit.key)
        try:
            with pytest.raises(LinkRefusedError, match="accepts none"):
                impostor.connect(f"127.0.0.1:{pair.decode_config.transfer_port}", timeout=10)
        finally:
            impostor.close()
        assert pair.decode.role.peers.get(pair.prefill_config.instance_name).is_open, "its own link is untouched"
        await _serves(pair)
