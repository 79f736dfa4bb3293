"""`disagg serve`'s command line: the only place that parses it.

Defaults come from the config dataclasses, so a default is written once.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from disagg.workers.config import KvTransferMode, KvTransport, Role, ServerConfig
from disagg.workers.engine.config import DEVICES, DTYPES, EngineConfig


def _default(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            assert f.default is not dataclasses.MISSING, f"{cls.__name__}.{name} has no default"
            return f.default
    raise AssertionError(f"{cls.__name__} has no field {name}")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    s, e = ServerConfig, EngineConfig
    role = p.add_argument_group("role and addresses")
    role.add_argument("--role", required=True, choices=[r.value for r in Role],
                      help="prefill and decode split a request across two workers; mixed runs both here")
    role.add_argument("--host", default=_default(s, "host"), help="address to listen on (default %(default)s)")
    role.add_argument("--advertise-host", default=_default(s, "advertise_host"),
                      help="address peers reach this worker at (default: --host, or 127.0.0.1 for a wildcard)")
    role.add_argument("--http-port", type=int, default=_default(s, "http_port"), help="OpenAI API (default %(default)s)")
    role.add_argument("--grpc-port", type=int, default=_default(s, "grpc_port"),
                      help="DisaggPDService (default %(default)s)")
    role.add_argument("--transfer-port", type=int, default=_default(s, "transfer_port"),
                      help="KV data path (default %(default)s)")
    role.add_argument("--served-model-name", default=_default(s, "served_model_name"),
                      help="the model name clients send (default: the --model source)")
    role.add_argument("--vllm-metric-aliases", action="store_true",
                      help="also export queue, KV-usage and latency metrics under vLLM's names (vllm:*), "
                           "for autoscaling recipes written for vLLM")
    kv = p.add_argument_group("KV transfer (prefill and decode roles)")
    kv.add_argument("--kv-transfer-mode", choices=[m.value for m in KvTransferMode],
                    default=_default(s, "kv_transfer_mode").value, help="default %(default)s")
    kv.add_argument("--kv-transport", choices=[t.value for t in KvTransport],
                    default=_default(s, "kv_transport").value, help="default %(default)s")
    kv.add_argument("--kv-connections", type=int, default=_default(s, "kv_connections"),
                    help="TCP connections a decode opens per link (default: one per two usable CPUs, 1 to 4)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--model", required=True,
                     help="a Hugging Face model folder, a GGUF file, or builtin:smollm2-135m")
    eng.add_argument("--device", choices=DEVICES, default=_default(e, "device"), help="default %(default)s")
    eng.add_argument("--dtype", choices=DTYPES, default=_default(e, "dtype"),
                     help="default %(default)s: float32 on a CPU, bfloat16 on CUDA")
    eng.add_argument("--block-size", type=int, default=_default(e, "block_size"),
                     help="tokens per KV block (default %(default)s)")
    eng.add_argument("--num-kv-blocks", type=int, default=_default(e, "num_kv_blocks"),
                     help="KV blocks in the pool (default: sized from memory)")
    eng.add_argument("--max-num-seqs", type=int, default=_default(e, "max_num_seqs"),
                     help="sequences in one batch (default %(default)s)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=_default(e, "max_num_batched_tokens"),
                     help="token budget of one engine step (default %(default)s)")
    eng.add_argument("--max-model-len", type=int, default=_default(e, "max_model_len"),
                     help="context length served (default: the model's)")
    eng.add_argument("--seed", type=int, default=_default(e, "seed"),
                     help="seed of requests that give none (default %(default)s)")


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The two configs of `disagg serve`; ValueError names what is wrong."""
    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    server = ServerConfig(
        role=Role(args.role),
        host=args.host,
        advertise_host=args.advertise_host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        transfer_port=args.transfer_port,
        served_model_name=args.served_model_name,
        kv_transfer_mode=KvTransferMode(args.kv_transfer_mode),
        kv_transport=KvTransport(args.kv_transport),
        kv_connections=args.kv_connections,
        vllm_metric_aliases=args.vllm_metric_aliases,
    )
    return engine, server
