"""OpenTelemetry traces of one PD request (workers/tracing.py, docs/tracing.md).

In this process, with the SDK's in-memory exporter: the helpers, the HTTP
span, and a prefill + decode pair's spans linked over real gRPC. Across two
`disagg serve` processes: each exports over OTLP/gRPC to a small collector
this test runs on loopback, and the decode's spans must hang under the
prefill's through the propagated `traceparent`; with no endpoint, none come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from disagg.workers import tracing
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.local import link

# The client's span: trace 4bf9..., span 00f0...
CLIENT_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
NUM_LAYERS = 2  # the tiny model's (tests/conftest.py)


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.configure("test", "here", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


# --- the helpers, in this process -----------------------------------------------


def test_configured_only_by_the_environment() -> None:
    assert tracing.exporter_name({}) is None  # the default: off
    assert tracing.exporter_name({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}) is None
    assert tracing.exporter_name({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == "otlp"
    assert tracing.exporter_name({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}) == "otlp"
    assert tracing.exporter_name({"OTEL_TRACES_EXPORTER": "console"}) == "console"
    assert tracing.exporter_name({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.exporter_name({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(ValueError, match="no such span exporter"):
        tracing.configure("test", environ={"OTEL_TRACES_EXPORTER": "no-such-exporter"})
    with pytest.raises(ValueError, match="OTLP over 'http/protobuf' is not installed"):
        tracing.configure("test", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert not tracing.is_enabled()


def test_off_is_a_no_op() -> None:
    assert not tracing.configure("test", environ={})
    assert not tracing.is_enabled()
    with tracing.span("x") as s, tracing.client_call("svc", "M", "127.0.0.1:1") as metadata:
        assert s is None and metadata == ()
    assert tracing.start("x") is None and tracing.current() is None and tracing.inject() == ()
    assert tracing.record("x", 0.0, 1.0) is None
    app = FastAPI()
    tracing.instrument(app, ["/v1/echo"])
    assert app.user_middleware == []  # not even a pass-through layer


def test_trace_context_round_trip(memory: InMemorySpanExporter) -> None:
    parent = tracing.extract([("TraceParent", TRACEPARENT.encode()), ("tracestate", "vendor=1"), ("other", "x")])
    assert tracing.extract([("other", "x")]) is None
    with tracing.span("root", parent=parent), tracing.client_call("svc.S", "M", "10.0.0.1:7777", {"a": 1}) as metadata:
        sent = dict(metadata)
    root, call = _by_name(memory, "root", "svc.S/M")
    assert call.attributes is not None and call.attributes["a"] == 1
    assert call.kind is SpanKind.CLIENT and call.attributes is not None
    assert call.attributes["rpc.system"] == "grpc" and call.attributes["server.port"] == 7777
    assert sent["traceparent"] == f"00-{CLIENT_TRACE_ID:032x}-{call.context.span_id:016x}-01"
    assert sent["tracestate"] == "vendor=1"
    assert root.context.trace_id == CLIENT_TRACE_ID and root.parent is not None
    assert root.parent.span_id == CLIENT_SPAN_ID and root.parent.is_remote


def _by_name(memory: InMemorySpanExporter, *names: str) -> list[ReadableSpan]:
    spans = {s.name: s for s in memory.get_finished_spans()}
    return [spans[n] for n in names]


async def test_http_span_takes_the_clients_traceparent(memory: InMemorySpanExporter) -> None:
    app = FastAPI()
    tracing.instrument(app, ["/v1/echo"])

    @app.post("/v1/echo")
    async def echo() -> dict[str, str]:
        tracing.annotate({tracing.GEN_AI_MODEL: "tiny"})
        return {"ok": "yes"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
        assert (await client.post("/v1/echo", headers={"traceparent": TRACEPARENT})).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/v1/other")).status_code == 404
    [span] = memory.get_finished_spans()  # only the paths asked for are traced
    assert span.name == "POST /v1/echo" and span.kind is SpanKind.SERVER
    assert span.context.trace_id == CLIENT_TRACE_ID and span.parent is not None
    assert span.parent.span_id == CLIENT_SPAN_ID
    assert span.attributes == {"http.request.method": "POST", "url.path": "/v1/echo", "url.scheme": "http",
                               "gen_ai.request.model": "tiny", "http.response.status_code": 200}


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_pd_pair_spans_link_over_grpc(memory: InMemorySpanExporter, pd_pair: Callable[..., Any],
                                            mode: str) -> None:
    async with pd_pair(mode) as pair:
        with tracing.span("client request", parent=tracing.extract([("traceparent", TRACEPARENT)])):
            tokens = [t async for out in pair.prefill.role.generate("t1", [5, 6, 7, 8, 9, 10], GREEDY)
                      for t in out.new_token_ids]
        assert len(tokens) == GREEDY.max_tokens
        await _until(lambda: {"decode", "relay"} <= {s.name for s in memory.get_finished_spans()})
    request = check_request_tree([Seen.of(s) for s in memory.get_finished_spans()], mode)
    assert request.name == "client request" and request.parent_id == CLIENT_SPAN_ID


@dataclass(frozen=True)
class Seen:
    """A finished span, as either exporter gives it."""

    name: str
    kind: SpanKind
    trace_id: int
    span_id: int
    parent_id: int | None
    attributes: dict[str, Any]

    @classmethod
    def of(cls, span: ReadableSpan) -> Seen:
        assert span.context is not None
        return cls(span.name, span.kind, span.context.trace_id, span.context.span_id,
                   None if span.parent is None else span.parent.span_id, dict(span.attributes or {}))


def check_request_tree(spans: list[Seen], mode: str) -> Seen:
    """The spans of one handed-off request: one trace, the client's; the prefill's under the
    request's span (returned), the decode's under the prefill's calls that reached it; counts and bytes."""
    assert {s.trace_id for s in spans} == {CLIENT_TRACE_ID}, "one trace, the client's"
    by_id = {s.span_id: s for s in spans}
    named: dict[str, list[Any]] = {}
    for s in spans:
        named.setdefault(s.name, []).append(s)

    def one(name: str, kind: SpanKind = SpanKind.INTERNAL) -> Any:
        [found] = [s for s in named.get(name, []) if s.kind is kind]
        return found

    def parent(s: Any) -> Any:
        return by_id[s.parent_id]

    route, add_client = one("route"), one("xllm.proto.DisaggPDService/AddNewRequests", SpanKind.CLIENT)
    add_server = one("xllm.proto.DisaggPDService/AddNewRequests", SpanKind.SERVER)
    first_client = one("xllm.proto.DisaggPDService/FirstGeneration", SpanKind.CLIENT)
    first_server = one("xllm.proto.DisaggPDService/FirstGeneration", SpanKind.SERVER)
    request = parent(route)
    # The prefill's spans hang under the request's; the decode's under the calls that reached it.
    for name in ("queue", "prefill", "relay"):
        assert parent(one(name)) is request, name
    assert parent(add_client) is route and parent(first_client) is request
    assert parent(add_server) is add_client and parent(first_server) is first_client
    decode = one("decode")
    assert parent(decode) is first_server
    assert decode.attributes["gen_ai.usage.output_tokens"] == GREEDY.max_tokens
    relays = [s for s in named["Generations"] if s.kind is SpanKind.CLIENT]
    assert relays and all(parent(s) is decode for s in relays)
    assert sum(s.attributes["disagg.tokens"] for s in relays) == GREEDY.max_tokens - 1  # the prefill sent the first
    assert one("prefill").attributes["gen_ai.usage.input_tokens"] > 0
    assert one("relay").attributes["gen_ai.usage.output_tokens"] == GREEDY.max_tokens
    received = one("kv_receive")
    assert received.attributes["disagg.kv.mode"] == mode and received.attributes["disagg.kv.bytes"] > 0
    if mode == "PUSH":
        assert parent(received) is add_server  # the bytes land after the admission, before FirstGeneration
        sent = one("kv_transfer")
        assert parent(sent) is request and sent.attributes["disagg.kv.bytes"] == received.attributes["disagg.kv.bytes"]
        layers = sorted(named["kv_transfer.layer"], key=lambda s: s.attributes["disagg.kv.layer"])
        assert [s.attributes["disagg.kv.layer"] for s in layers] == list(range(NUM_LAYERS))
        assert all(parent(s) is sent for s in layers)
        assert sum(s.attributes["disagg.kv.bytes"] for s in layers) == sent.attributes["disagg.kv.bytes"]
    else:
        assert parent(received) is first_server  # pulled inside FirstGeneration
    return request


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for spans"
        await asyncio.sleep(0.05)


# --- two `disagg serve` processes, exporting over OTLP/gRPC -----------------------

OTLP_DEFAULT_PORT = 4317  # where an SDK with no endpoint configured would export
# OTLP's span kinds (SPAN_KIND_INTERNAL = 1, ...) as the SDK names them (INTERNAL = 0, ...).
_KINDS = {1: SpanKind.INTERNAL, 2: SpanKind.SERVER, 3: SpanKind.CLIENT, 4: SpanKind.PRODUCER, 5: SpanKind.CONSUMER}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on loopback: `TraceService/Export`, keeping every span with its service name."""

    def __init__(self, port: int = 0) -> None:
        self.spans: list[tuple[str, Seen]] = []
        self.exports = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._server.start()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            self.exports += 1
            for resource_spans in request.resource_spans:
                service = _attributes(resource_spans.resource.attributes)["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(service, _seen(s)) for s in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def names(self) -> set[str]:
        with self._lock:
            return {s.name for _, s in self.spans}

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


def _seen(span: Any) -> Seen:
    return Seen(span.name, _KINDS[span.kind], int.from_bytes(span.trace_id, "big"), int.from_bytes(span.span_id, "big"),
                int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else None,
                _attributes(span.attributes))


def _attributes(pairs: Any) -> dict[str, Any]:
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {kv.key: value(kv.value) for kv in pairs}


def _complete(prefill: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": GREEDY.max_tokens, "temperature": 0,
            "ignore_eos": True}
    answer = httpx.post(f"{prefill.base_url}/v1/completions", json=body, headers={"traceparent": TRACEPARENT},
                        timeout=60.0)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_processes_export_one_linked_trace(processes: Any) -> None:
    with Collector() as otlp:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
        decode, prefill = processes.start(("decode",), ("prefill", "--kv-transfer-mode", "PUSH"), env=env)
        assert link(decode, prefill) is None
        processes.wait_until(lambda: httpx.get(f"{prefill.base_url}/ready").status_code == 200, "the prefill is ready")
        answer = _complete(prefill)
        assert answer["usage"]["completion_tokens"] == GREEDY.max_tokens
        processes.wait_until(lambda: {"POST /v1/completions", "decode", "relay"} <= otlp.names(),
                             "both workers exported the request's spans")
        spans = [s for _, s in otlp.spans]
        services = {s.span_id: service for service, s in otlp.spans}
        # A streamed chat, with no traceparent: a trace of its own, its HTTP span ended after the last event.
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                "ignore_eos": True}
        streamed = httpx.post(f"{prefill.base_url}/v1/chat/completions", json=body, timeout=60.0)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        processes.wait_until(lambda: "POST /v1/chat/completions" in otlp.names(), "the streamed request's span")
        [chat] = [s for _, s in otlp.spans if s.name == "POST /v1/chat/completions"]
    assert chat.parent_id is None and chat.trace_id != CLIENT_TRACE_ID
    assert chat.attributes["gen_ai.operation.name"] == "chat" and chat.attributes["gen_ai.usage.output_tokens"] == 4
    request = check_request_tree(spans, "PUSH")
    assert request.name == "POST /v1/completions" and request.kind is SpanKind.SERVER
    assert request.parent_id == CLIENT_SPAN_ID, "the client's traceparent is honoured"
    assert request.attributes["gen_ai.request.model"] == "tiny"
    assert request.attributes["gen_ai.operation.name"] == "text_completion"
    assert request.attributes["gen_ai.request.max_tokens"] == GREEDY.max_tokens
    assert request.attributes["gen_ai.usage.input_tokens"] == 6
    assert request.attributes["gen_ai.usage.output_tokens"] == GREEDY.max_tokens
    assert request.attributes["http.response.status_code"] == 200
    # Each process exported its own spans: the decode's came over the propagated context.
    on_decode = {s.name for s in spans if services[s.span_id] == "disagg-decode"}
    assert on_decode == {"xllm.proto.DisaggPDService/AddNewRequests", "xllm.proto.DisaggPDService/FirstGeneration",
                         "kv_receive", "decode", "Generations"}
    assert {services[s.span_id] for s in spans} == {"disagg-prefill", "disagg-decode"}


def test_processes_without_an_endpoint_export_nothing(processes: Any) -> None:
    # An SDK installed with no endpoint configured would export to localhost:4317: listen there.
    try:
        otlp = Collector(OTLP_DEFAULT_PORT)
    except RuntimeError:  # grpc could not bind it
        pytest.skip(f"port {OTLP_DEFAULT_PORT} is taken")
    with otlp:
        env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": "off"}
        decode, prefill = processes.start(("decode",), ("prefill",), env=env)
        assert link(decode, prefill) is None
        processes.wait_until(lambda: httpx.get(f"{prefill.base_url}/ready").status_code == 200, "the prefill is ready")
        _complete(prefill)
        assert [w.stop() for w in (prefill, decode)] == [0, 0]  # a tracer provider would flush on the way out
        assert otlp.exports == 0 and otlp.spans == []
    assert "traces: on" not in prefill.log() + decode.log()
