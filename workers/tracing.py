"""OpenTelemetry traces of a request across the prefill, the KV transfer and the
decode (docs/tracing.md), behind a few typed helpers.

Off unless the environment configures an exporter: an OTLP endpoint
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) or an
explicit `OTEL_TRACES_EXPORTER`; `OTEL_TRACES_EXPORTER=none` or
`OTEL_SDK_DISABLED=true` keep it off. Off, no SDK tracer provider exists and
every helper returns after one check of `_tracer`, so the request path pays
nothing else. The SDK reads its other standard variables itself
(`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`,
`OTEL_BSP_*`, the exporter's `OTEL_EXPORTER_OTLP_*`).

The W3C trace context (`traceparent`, `tracestate`) comes from the client's
HTTP headers and travels over our gRPC calls as metadata of the same names,
outside the protobuf messages: the wire stays xLLM's, and an xLLM peer ignores
the metadata. The current span follows the asyncio context, so tasks a request
starts inherit it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, ContextManager

from opentelemetry import context as otel_context, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

log = logging.getLogger(__name__)

Attributes = Mapping[str, AttributeValue]
Metadata = tuple[tuple[str, str], ...]

# Semantic-convention attribute names (gen_ai.*, rpc.*, http.*), and ours under disagg.*.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
KV_BYTES = "disagg.kv.bytes"
KV_BLOCKS = "disagg.kv.blocks"
KV_CACHED_BLOCKS = "disagg.kv.cached_blocks"
KV_LAYER = "disagg.kv.layer"
KV_MODE = "disagg.kv.mode"
PEER = "disagg.peer"  # the other instance's name
REQUEST_ID = "disagg.request_id"

_W3C = TraceContextTextMapPropagator()
_OFF: ContextManager[Any] = contextlib.nullcontext()
_NO_METADATA: ContextManager[Metadata] = contextlib.nullcontext(())
_INSTRUMENTATION = "disagg"

_provider: Any = None  # the SDK's TracerProvider while on (typed loosely: the SDK is imported only then)
_tracer: trace.Tracer | None = None


def exporter_name(environ: Mapping[str, str]) -> str | None:
    """The span exporter the environment asks for; None: tracing stays off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    name = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if name:
        first = name.split(",")[0].strip()  # one exporter: ours is a single pipeline
        return None if first == "none" else first
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return "otlp" if endpoint else None


def configure(role: str, instance: str = "", exporter: Any = None,
              environ: Mapping[str, str] | None = None) -> bool:
    """Install a tracer provider when the environment configures an exporter, or with
    `exporter` (a SpanExporter, exported span by span: tests); whether tracing is on.
    ValueError for an exporter we cannot build. `environ` (default `os.environ`) decides
    the exporter; the SDK reads its other variables from `os.environ`."""
    global _provider, _tracer
    env = os.environ if environ is None else environ
    name = None if exporter is not None else exporter_name(env)
    if exporter is None and name is None:
        return False
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    span_exporter = exporter if exporter is not None else _build_exporter(name or "", env)  # refused before any change
    resource = Resource.create({"disagg.role": role, **({SERVICE_INSTANCE_ID: instance} if instance else {})})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # no OTEL_SERVICE_NAME
        resource = resource.merge(Resource({SERVICE_NAME: f"disagg-{role}"}))
    shutdown()
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    processor = SimpleSpanProcessor if exporter is not None else BatchSpanProcessor
    provider.add_span_processor(processor(span_exporter))
    _provider, _tracer = provider, provider.get_tracer(_INSTRUMENTATION)
    log.info("traces: on, exported with %s as %s", name or type(exporter).__name__,
             resource.attributes.get(SERVICE_NAME))
    return True


def _build_exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "otlp":
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        if protocol != "grpc":
            raise ValueError(f"OTLP over {protocol!r} is not installed: this worker exports OTLP over grpc "
                             "(set OTEL_EXPORTER_OTLP_PROTOCOL=grpc, or unset it)")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # endpoint, headers, TLS and timeout from OTEL_EXPORTER_OTLP_*
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: no such span exporter is installed "
                         "(this worker has 'otlp', 'console' and 'none')")
    return next(iter(found)).load()()


def shutdown() -> None:
    """Export what is buffered and turn tracing off."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer = None, None


def is_enabled() -> bool:
    return _tracer is not None


# --- spans ---------------------------------------------------------------------


def span(name: str, attributes: Attributes | None = None, kind: SpanKind = SpanKind.INTERNAL,
         parent: Context | None = None) -> ContextManager[Span | None]:
    """A span around a block, current inside it (tasks started there are its children);
    the block gets None when tracing is off. An exception ends it with an error status."""
    if _tracer is None:
        return _OFF
    return _tracer.start_as_current_span(name, parent, kind, attributes)


def start(name: str, attributes: Attributes | None = None, parent: Context | None = None) -> Span | None:
    """A span the caller ends (`end`), child of `parent` or of the current span; None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, parent, attributes=attributes)


def end(span: Span | None, attributes: Attributes | None = None) -> None:
    """End a span of `start` (None: nothing), with these attributes added."""
    if span is not None:
        if attributes:
            span.set_attributes(attributes)
        span.end()


def record(name: str, started: float, ended: float, attributes: Attributes | None = None,
           parent: Context | None = None) -> Context | None:
    """A span after the fact, from `time.monotonic()` readings (queue wait, a layer's transfer);
    the context that parents spans under it, None when off."""
    if _tracer is None:
        return None
    offset = time.time_ns() - time.monotonic_ns()
    s = _tracer.start_span(name, parent, attributes=attributes, start_time=offset + int(started * 1e9))
    s.end(end_time=offset + int(ended * 1e9))
    return trace.set_span_in_context(s)


def context_of(span: Span | None) -> Context | None:
    """A context that parents spans under `span` (None: the current one)."""
    return None if span is None else trace.set_span_in_context(span)


def annotate(attributes: Attributes) -> None:
    """Add attributes to the current span (the request's HTTP span, a gRPC server span)."""
    if _tracer is not None:
        trace.get_current_span().set_attributes(attributes)


def current() -> Context | None:
    """The current context, to parent spans started later elsewhere; None when off."""
    return None if _tracer is None else otel_context.get_current()


# --- W3C trace context over HTTP headers and gRPC metadata ---------------------


def extract(carrier: Iterable[tuple[str, str | bytes]]) -> Context | None:
    """The remote parent in HTTP headers or gRPC metadata (`traceparent`, `tracestate`); None without one."""
    found = {k.lower(): v.decode("latin-1") if isinstance(v, bytes) else v for k, v in carrier
             if k.lower() in ("traceparent", "tracestate")}
    return _W3C.extract(found) if "traceparent" in found else None


def inject() -> Metadata:
    """The current span's `traceparent` (and `tracestate`) as gRPC metadata; () when off."""
    if _tracer is None:
        return ()
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return tuple(carrier.items())


def rpc_attributes(service: str, method: str, peer: str) -> dict[str, AttributeValue]:
    host, _, port = peer.rpartition(":")
    attributes: dict[str, AttributeValue] = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                                             "server.address": host or peer}
    if port.isdigit():
        attributes["server.port"] = int(port)
    return attributes


def client_call(service: str, method: str, peer: str, attributes: Attributes | None = None
                ) -> ContextManager[Metadata]:
    """A CLIENT span around one gRPC call to `peer`; the block gets the metadata that
    carries it to the server (append it to the call's), () when off."""
    if _tracer is None:
        return _NO_METADATA
    return _client_call(_tracer, service, method, peer, attributes or {})


@contextlib.contextmanager
def _client_call(tracer: trace.Tracer, service: str, method: str, peer: str,
                 attributes: Attributes) -> Iterator[Metadata]:
    with tracer.start_as_current_span(f"{service}/{method}", kind=SpanKind.CLIENT,
                                      attributes={**rpc_attributes(service, method, peer), **attributes}):
        yield inject()


def server_call(service: str, method: str, metadata: Sequence[tuple[str, str | bytes]] | None
                ) -> ContextManager[Span | None]:
    """A SERVER span around a gRPC handler, child of the caller's span named in `metadata`."""
    if _tracer is None:
        return _OFF
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    return _tracer.start_as_current_span(f"{service}/{method}", extract(metadata or ()), SpanKind.SERVER,
                                         attributes)


# --- the client's HTTP request -------------------------------------------------


class HttpTracing:
    """ASGI middleware: a SERVER span for each request to one of `paths` (fixed paths, so span
    names stay few), child of the client's `traceparent`, ended once the response (a stream too) is sent."""

    def __init__(self, app: Any, paths: Iterable[str]) -> None:
        self.app = app
        self._paths = frozenset(paths)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if _tracer is None or scope["type"] != "http" or scope["path"] not in self._paths:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = [(k.decode("latin-1"), v) for k, v in scope.get("headers", ())]
        attributes = {"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http")}
        with _tracer.start_as_current_span(f"{method} {path}", extract(headers), SpanKind.SERVER,
                                           attributes) as current:

            async def send_traced(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    current.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        current.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_traced)


def instrument(app: Any, paths: Iterable[str]) -> None:
    """Trace the requests to `paths` of `app` (a FastAPI app); nothing when tracing is off."""
    if _tracer is not None:
        app.add_middleware(HttpTracing, paths=paths)
