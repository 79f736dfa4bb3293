"""`disagg serve`'s command line: the only place that parses it.

Defaults come from the config dataclasses, so a default is written once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from disagg.proto.vocabulary import (
    ADMIN_PORT_OFFSET, API_KEY_ENV, DEVICES, DTYPES, KV_CHECKSUMS, PD_POLICIES, TRANSFER_MODES, TRANSPORTS, PDPolicy,
)
from disagg.workers.config import (
    PREFILL_CPU_STEP_TOKENS, CorsPolicy, Role, ServerConfig, TransferMode, Transport, default_step_tokens,
)
from disagg.workers.engine.config import EngineConfig
from disagg.workers.security.key import KEY_ENV, KEY_FILE_ENV, ClusterKey, default_key_file, key_from_environment
from disagg.workers.security.tls import CA_FILE, CERT_FILE, KEY_FILE, TlsFiles

N = TypeVar("N", int, float)



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
    role.add_argument("--admin-port", type=int, default=None,
                      help=f"/drain (and xLLM's HTTP link routes) (default: --http-port + {ADMIN_PORT_OFFSET})")
    role.add_argument("--served-model-name", default=_default(s, "served_model_name"),
                      help="the model name clients send (default: the --model source)")
    client = p.add_argument_group("client API")
    client.add_argument("--api-key", default=None,
                        help=f"clients send it as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)")
    cors = CorsPolicy()
    client.add_argument("--allowed-origins", type=_json_strings, default=list(cors.allowed_origins), metavar="JSON",
                        help='CORS: origins of browser pages that may call the API, a JSON list (default \'["*"]\')')
    client.add_argument("--allowed-methods", type=_json_strings, default=list(cors.allowed_methods), metavar="JSON",
                        help="CORS: HTTP methods allowed, a JSON list (default '[\"*\"]')")
    client.add_argument("--allowed-headers", type=_json_strings, default=list(cors.allowed_headers), metavar="JSON",
                        help="CORS: request headers allowed, a JSON list (default '[\"*\"]')")
    client.add_argument("--allow-credentials", action="store_true", default=cors.allow_credentials,
                        help="CORS: let browser pages send cookies and credentials (default: no)")
    client.add_argument("--max-queued-requests", type=int, default=_default(s, "max_queued_requests"),
                        help="client requests held beyond --max-num-seqs before answering 429 (default: 4 x --max-num-seqs)")
    role.add_argument("--vllm-metric-aliases", action="store_true",
                      help="also export queue, KV-usage and latency metrics under vLLM's names (vllm:*), "
                           "for autoscaling recipes written for vLLM")
    kv = p.add_argument_group("KV transfer (prefill and decode roles)")
    kv.add_argument("--kv-transfer-mode", choices=TRANSFER_MODES,
                    default=_default(s, "kv_transfer_mode").value, help="default %(default)s")
    kv.add_argument("--kv-transport", choices=TRANSPORTS,
                    default=_default(s, "kv_transport").value, help="default %(default)s")
    kv.add_argument("--kv-connections", type=int, default=_default(s, "kv_connections"),
                    help="TCP connections a decode opens per link (default: one per two usable CPUs, 1 to 4)")
    kv.add_argument("--kv-checksum", choices=KV_CHECKSUMS, default=_default(s, "kv_checksum"),
                    help="payload checksum of TCP KV links: auto skips it on loopback and TLS links, where it "
                         "buys nothing, and uses xxh3 elsewhere (default %(default)s)")
    kv.add_argument("--pd-policy", choices=PD_POLICIES, default=_default(s, "pd_policy").value,
                    help="always: a prefill hands every request to a decode; auto: it serves a request itself when "
                         "the hand-off costs more than it saves (default %(default)s)")
    kv.add_argument("--pd-local-max-tokens", type=int, default=_default(s, "pd_local_max_tokens"),
                    help="auto: uncached prompt tokens a prefill always serves itself (default %(default)s)")
    kv.add_argument("--pd-local-max-running", type=int, default=_default(s, "pd_local_max_running"),
                    help="auto: requests a prefill serves itself at once (default %(default)s)")
    kv.add_argument("--kv-prefix-reuse", action=argparse.BooleanOptionalAction,
                    default=_default(s, "kv_prefix_reuse"),
                    help="a decode shares the prompt blocks its prefix cache already holds, and the prefill sends "
                         "only the rest (default: on)")
    kv.add_argument("--max-migrations", type=int, default=_default(s, "max_migrations"),
                    help="times a prefill moves one stream to another decode when its decode fails it, "
                         "0 for never (default %(default)s)")
    kv.add_argument("--stream-idle-timeout", type=float, default=_default(s, "stream_idle_timeout_s"),
                    metavar="SECONDS", help="a prefill fails a handed-off stream that gets no token from its decode "
                                            "for this long (default %(default)s)")
    add_key_arguments(p)
    sec = p.add_argument_group("security")
    sec.add_argument("--allow-anonymous-peers", action="store_true",
                     help="accept gRPC and HTTP link calls that carry no credential (an xLLM peer); a wrong one "
                          "is still refused")
    eng = p.add_argument_group("engine")
    eng.add_argument("--model", required=True,
                     help="a Hugging Face model folder, a GGUF file, or builtin:smollm2-135m")
    eng.add_argument("--device", choices=DEVICES, default=_default(e, "device"), help="default %(default)s")
    eng.add_argument("--dtype", choices=DTYPES, default=_default(e, "dtype"),
                     help="default %(default)s: bfloat16 on CUDA and on CPUs with native bf16 "
                          "(AMX, AVX-512 BF16), else float32")
    eng.add_argument("--block-size", type=int, default=_default(e, "block_size"),
                     help="tokens per KV block (default %(default)s)")
    eng.add_argument("--num-kv-blocks", type=int, default=_default(e, "num_kv_blocks"),
                     help="KV blocks in the pool (default: sized from memory)")
    eng.add_argument("--max-num-seqs", type=int, default=_default(e, "max_num_seqs"),
                     help="sequences in one batch (default %(default)s)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help=f"token budget of one engine step (default: {_default(e, 'max_num_batched_tokens')}; a prefill "
                          f"on a CPU takes {PREFILL_CPU_STEP_TOKENS}, with --cpu-turn-dir only while a decode "
                          "has requests)")
    eng.add_argument("--max-model-len", type=int, default=_default(e, "max_model_len"),
                     help="context length served (default: the model's)")
    eng.add_argument("--threads", type=int, default=_default(s, "threads"),
                     help="compute threads (default: $OMP_NUM_THREADS, else the CPUs this process may use, "
                          "from its affinity and cgroup quota)")
    eng.add_argument("--cpu-turn-dir", type=Path, default=_default(s, "cpu_turn_dir"), metavar="DIR",
                     help="a prefill and a decode on the same cores take turns at stepping through lock files "
                          "in DIR (both get the same DIR): while the prefill holds at least as many requests as "
                          "the decode runs, its prompts go first, as a mixed worker orders them (default: no turns)")
    eng.add_argument("--cpu-turn-wait-ms", type=float, default=_default(s, "cpu_turn_wait_s") * 1000,
                     metavar="MS", help="with --cpu-turn-dir: the longest a decode step waits for the prefill's prompts, "
                          "the TPOT its requests give up to them (default %(default)g)")
    eng.add_argument("--seed", type=int, default=_default(e, "seed"),
                     help="seed of requests that give none (default %(default)s)")


def positive(kind: Callable[[str], N]) -> Callable[[str], N]:
    """An argparse type: a number of `kind` above 0 and finite (a timeout of 0, -1 or nan is refused)."""
    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form of the CORS flags)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\', got {text!r}')
    return value


def add_key_arguments(p: argparse.ArgumentParser) -> None:
    """--cluster-key-file and --insecure, shared by serve, link and unlink (`disagg demo` makes a key of its own)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--cluster-key-file", default=default_key_file(), metavar="PATH",
                       help=f"the cluster's shared key (default: ${KEY_FILE_ENV}; else the key itself in ${KEY_ENV})")
    group.add_argument("--insecure", action="store_true",
                       help="no cluster key: anyone who reaches the ports can link, send requests and read KV")
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help=f"mutual TLS for gRPC and the TCP KV transfer: {CERT_FILE}, {KEY_FILE} and {CA_FILE} in DIR "
                        "(a cert-manager Secret's layout); default: plaintext")


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS folder of --tls-dir, checked; None without it. ValueError when its files are unusable."""
    return None if args.tls_dir is None else TlsFiles.from_folder(args.tls_dir)


def cluster_key(args: argparse.Namespace) -> ClusterKey | None:
    """The key named by --cluster-key-file, else the one in $DISAGG_CLUSTER_KEY; None with --insecure.
    ValueError when none is given."""
    if args.insecure:
        return None
    if args.cluster_key_file:
        return ClusterKey.from_file(args.cluster_key_file)
    key = key_from_environment()
    if key is None:
        raise ValueError(f"give --cluster-key-file PATH (or set {KEY_FILE_ENV}, or the key itself in {KEY_ENV}), "
                         "or --insecure on purpose")
    return key


def build_configs(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    """The two configs of `disagg serve` (`env`: os.environ by default); ValueError names what is wrong."""
    env = os.environ if env is None else env
    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    budget = args.max_num_batched_tokens
    engine = dataclasses.replace(engine, max_num_batched_tokens=(
        budget if budget is not None else default_step_tokens(Role(args.role), engine, args.cpu_turn_dir is not None)))
    server = ServerConfig(
        role=Role(args.role),
        host=args.host,
        advertise_host=args.advertise_host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        transfer_port=args.transfer_port,
        admin_port=args.admin_port if args.admin_port is not None else args.http_port + ADMIN_PORT_OFFSET,
        api_key=args.api_key if args.api_key is not None else env.get(API_KEY_ENV),
        cors=CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                        args.allow_credentials),
        max_queued_requests=args.max_queued_requests,
        served_model_name=args.served_model_name,
        kv_transfer_mode=TransferMode(args.kv_transfer_mode),
        kv_transport=Transport(args.kv_transport),
        kv_connections=args.kv_connections,
        kv_checksum=args.kv_checksum,
        stream_idle_timeout_s=args.stream_idle_timeout,
        kv_prefix_reuse=args.kv_prefix_reuse,
        max_migrations=args.max_migrations,
        pd_policy=PDPolicy(args.pd_policy),
        pd_local_max_tokens=args.pd_local_max_tokens,
        pd_local_max_running=args.pd_local_max_running,
        cluster_key=None if args.role == Role.MIXED.value and not args.cluster_key_file else cluster_key(args),
        insecure=args.insecure,
        allow_anonymous_peers=args.allow_anonymous_peers,
        tls=tls_files(args),
        threads=args.threads,
        cpu_turn_dir=args.cpu_turn_dir,
        cpu_turn_wait_s=args.cpu_turn_wait_ms / 1000,
        vllm_metric_aliases=args.vllm_metric_aliases,
    )
    return engine, server
