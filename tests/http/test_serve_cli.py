"""`disagg serve` as a command: bad settings and bad models fail with a reason; defaults that follow the
machine (KV connections, compute threads, OpenMP waiting); metric names; the frozen heap."""

from __future__ import annotations

import contextlib

import argparse
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from disagg.proto.vocabulary import InstanceInfo
from disagg.workers import cli
from disagg.workers.args import add_serve_arguments, build_configs
from disagg.workers.config import (
    PREFILL_CPU_STEP_TOKENS, CorsPolicy, ServerConfig, default_kv_connections, default_threads, usable_cpus,
)
from disagg.workers.demo import running_pair
from disagg.workers.engine.config import EngineConfig
from disagg.workers.heap import freeze_startup_heap
from disagg.workers.local import free_port
from disagg.workers.pd.service import Handlers, build_grpc_server
from disagg.workers.security.control import ControlGuard
from disagg.workers.server import listening_sockets, loopback_listener

SERVE = [sys.executable, "-m", "disagg.workers", "serve"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=120)


def test_invalid_settings_fail_before_loading() -> None:
    result = _run("--role", "mixed", "--model", "x", "--http-port", "7777")
    assert result.returncode == 2
    assert "must differ" in result.stderr
    result = _run("--role", "mixed", "--model", "x", "--block-size", "3")
    assert result.returncode == 2
    assert "block_size must be a power of two" in result.stderr
    result = _run("--role", "decode", "--model", "x", "--insecure", "--kv-connections", "0")
    assert result.returncode == 2
    assert "kv_connections must be between 1 and 64" in result.stderr
    result = _run("--role", "decode", "--model", "x", "--insecure", "--kv-checksum", "md5")
    assert result.returncode == 2 and "invalid choice: 'md5'" in result.stderr
    result = _run("--role", "mixed", "--model", "x", "--threads", "0")
    assert result.returncode == 2
    assert "threads must be at least 1" in result.stderr
    result = _run("--role", "mixed", "--model", "x", "--admin-port", "8000")
    assert result.returncode == 2 and "admin_port must differ" in result.stderr
    result = _run("--role", "mixed", "--model", "x", "--max-queued-requests", "-1")
    assert result.returncode == 2 and "max_queued_requests must be >= 0" in result.stderr


def _configs(*flags: str, env: Mapping[str, str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    """`disagg serve`'s configs from `flags`, as its command line builds them."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return build_configs(parser.parse_args(list(flags)), env={} if env is None else env)


MIXED = ("--role", "mixed", "--model", "x")


def test_a_mixed_worker_names_the_pd_settings_it_ignores() -> None:
    """It has no KV transfer, hand-off or migration: such flags are said to be ignored, not taken silently."""
    flags = ("--kv-transport", "nccl", "--pd-policy", "auto", "--max-migrations", "5")
    assert _configs(*MIXED)[1].ignored_settings() == []
    assert _configs(*MIXED, *flags)[1].ignored_settings() == ["kv_transport", "max_migrations", "pd_policy"]
    prefill = _configs("--role", "prefill", "--model", "x", "--insecure", *flags)[1]
    assert prefill.ignored_settings() == []


def test_the_api_key_comes_from_the_flag_or_the_environment() -> None:
    _, server = _configs(*MIXED, env={"DISAGG_API_KEY": "from-env"})
    assert server.api_key == "from-env" and "from-env" not in repr(server), "the key stays out of logs"
    _, server = _configs(*MIXED, "--api-key", "from-flag", env={"DISAGG_API_KEY": "from-env"})
    assert server.api_key == "from-flag"
    _, server = _configs(*MIXED)
    assert server.api_key is None
    with pytest.raises(ValueError, match="api_key must not be blank"):
        _configs(*MIXED, "--api-key", " ")


def test_the_cors_flags_are_vllms_json_lists() -> None:
    _, server = _configs(*MIXED)
    assert server.cors == CorsPolicy(("*",), ("*",), ("*",), False)  # vLLM's defaults
    _, server = _configs(*MIXED, "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["POST"]',
                         "--allowed-headers", "[]", "--allow-credentials")
    assert server.cors == CorsPolicy(("https://a.example",), ("POST",), (), True)
    result = _run("--role", "mixed", "--model", "x", "--allowed-origins", "https://a.example")
    assert result.returncode == 2 and "JSON list of strings" in result.stderr


def test_the_admin_port_follows_the_http_port_unless_given() -> None:
    """Two workers on one host given only distinct HTTP ports (DESIGN.md's flags) bind distinct admin ports."""
    assert _configs(*MIXED)[1].admin_port == 8100
    assert _configs(*MIXED, "--http-port", "8001")[1].admin_port == 8101
    assert _configs(*MIXED, "--http-port", "8001", "--admin-port", "9000")[1].admin_port == 9000


def test_cpu_turns_come_from_the_flags(tmp_path: Path) -> None:
    base = ["--role", "decode", "--model", "x", "--insecure"]
    _, server = _configs(*base, "--cpu-turn-dir", str(tmp_path), "--cpu-turn-wait-ms", "500")
    assert server.cpu_turn_dir == tmp_path and server.cpu_turn_wait_s == 0.5
    _, server = _configs(*base)
    assert server.cpu_turn_dir is None
    result = _run("--role", "mixed", "--model", "x", "--cpu-turn-dir", str(tmp_path))
    assert result.returncode == 2 and "a mixed worker orders its own steps" in result.stderr


@pytest.mark.parametrize(("role", "device", "flag", "budget"), [
    ("prefill", "cpu", None, PREFILL_CPU_STEP_TOKENS),  # prompts only: small steps, earlier first tokens
    ("mixed", "cpu", None, EngineConfig.max_num_batched_tokens),  # its decodes ride in its steps
    ("decode", "cpu", None, EngineConfig.max_num_batched_tokens),
    ("prefill", "cuda", None, EngineConfig.max_num_batched_tokens),  # a GPU needs large steps to fill
    ("prefill", "cpu", "4096", 4096),  # the flag wins
    ("mixed", "cpu", "100", 100),
    ("prefill turns", "cpu", None, EngineConfig.max_num_batched_tokens),  # its turns narrow it while decodes run
])
def test_the_step_budget_follows_the_role_unless_given(role: str, device: str, flag: str | None, budget: int) -> None:
    given = [] if flag is None else ["--max-num-batched-tokens", flag]
    role, _, turns = role.partition(" ")
    given += ["--cpu-turn-dir", "turns"] if turns else []
    engine, _ = _configs("--role", role, "--model", "x", "--device", device, "--insecure", *given)
    assert engine.max_num_batched_tokens == budget


@pytest.mark.parametrize(("cpu_max", "expected"), [
    (None, "affinity"),  # no cgroup v2 file
    ("max 100000\n", "affinity"),  # no quota
    ("150000 100000\n", 2),  # 1.5 CPUs of quota: 2 CPUs run it
    ("50000 100000\n", 1),
    ("not a quota\n", "affinity"),
])
def test_usable_cpus_follow_the_cgroup_quota(tmp_path: Path, cpu_max: str | None, expected: int | str) -> None:
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(path) == (affinity if expected == "affinity" else min(affinity, int(expected)))


@pytest.mark.parametrize(("cpus", "connections"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (128, 4)])
def test_default_kv_connections_is_one_per_two_cpus_up_to_four(cpus: int, connections: int) -> None:
    assert default_kv_connections(cpus) == connections


def test_bad_values_the_config_reads_late_fail_before_loading() -> None:
    """Each was a traceback, an error after the model loaded, or accepted (nan turned a failover off)."""
    result = subprocess.run([*SERVE, "--role", "mixed", "--model", "x"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "many"})
    assert result.returncode == 2 and "OMP_NUM_THREADS must be a whole number" in result.stderr
    assert "Traceback" not in result.stderr
    result = _run("--role", "prefill", "--insecure", "--model", "x", "--stream-idle-timeout", "nan")
    assert result.returncode == 2 and "stream_idle_timeout_s must be positive and finite" in result.stderr
    result = _run("--role", "mixed", "--model", "x", "--seed", str(2**70))
    assert result.returncode == 2 and "seed must be between" in result.stderr


def test_a_port_it_cannot_listen_on_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("--role", "mixed", "--model", "x", "--host", "127.0.0.1", "--http-port", str(port),
                      "--admin-port", str(free_port()))
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("flag", "purpose"), [("--grpc-port", "gRPC"), ("--transfer-port", "KV transfer")])
def test_a_taken_grpc_or_transfer_port_fails_before_the_model_loads(flag: str, purpose: str) -> None:
    """Both bind only after the load: the taken port is told at once (the model "x" is never read)."""
    ports = {"--http-port": free_port(), "--admin-port": free_port(), "--grpc-port": free_port(),
             "--transfer-port": free_port()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports[flag] = taken.getsockname()[1]
        result = _run("--role", "prefill", "--insecure", "--model", "x", "--host", "127.0.0.1",
                      *(str(item) for pair in ports.items() for item in pair))
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{ports[flag]}: Address already in use (the {purpose} port)" in result.stderr
    assert "Traceback" not in result.stderr


async def test_the_grpc_server_does_not_share_a_port_another_server_holds() -> None:
    """gRPC's default SO_REUSEPORT let a second worker bind a taken port and take half its calls."""
    holder = grpc.aio.server()  # gRPC's defaults: SO_REUSEPORT on
    port = holder.add_insecure_port("127.0.0.1:0")
    await holder.start()
    try:
        handlers = Handlers(role="decode", unlink=lambda info: None)
        with pytest.raises(RuntimeError, match="Failed to bind"):
            build_grpc_server(handlers, f"127.0.0.1:{port}", 1 << 20, ControlGuard(None),
                              InstanceInfo(f"127.0.0.1:{port}", "127.0.0.1:1"))
    finally:
        await holder.stop(None)


def test_a_worker_stopped_while_it_loads_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while the model loads: a clean exit, not an abort under the loader thread (SIGABRT, 134)."""
    slow = tmp_path / "slow_load.py"  # the tiny model loads too fast to be caught loading
    slow.write_text("import time, torch, disagg.workers.engine.loader as loader\n"
                    "load = loader.load_model\n"
                    "def busy(*a, **k):  # inside torch's C++ for 5 s, as a real load is\n"
                    "    end = time.monotonic() + 5\n"
                    "    while time.monotonic() < end:\n"
                    "        torch.randn(512, 512) @ torch.randn(512, 512)\n"
                    "    return load(*a, **k)\n"
                    "loader.load_model = busy\n"
                    "from disagg.workers.cli import main\n"
                    "raise SystemExit(main())\n")
    worker = subprocess.Popen([sys.executable, str(slow), "serve", "--role", "mixed", "--model", str(tiny_model_dir),
                               "--host", "127.0.0.1", "--http-port", str(free_port()), "--admin-port", str(free_port())],
                              stderr=subprocess.PIPE, text=True)
    assert worker.stderr is not None
    for line in worker.stderr:
        if "Started server process" in line:  # listening, its signal handlers installed; the model loads
            break
    time.sleep(1.0)
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert "stopped before the model finished loading" in err


def test_unknown_role_is_an_argparse_error() -> None:
    result = _run("--role", "both", "--model", "x")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


@pytest.mark.parametrize(("role", "source", "words"), [
    ("mixed", "missing", "does not exist"), ("prefill", "missing", "does not exist"),
    ("decode", "missing", "does not exist"), ("mixed", "builtin:nope", "unknown builtin model 'nope'"),
    ("mixed", "passwd", "is not a .gguf file"), ("mixed", ".", "has no config.json")])
def test_a_model_source_that_cannot_be_one_fails_before_any_server_starts(
        tmp_path: Path, role: str, source: str, words: str) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    if source in ("missing", "passwd", "."):
        source = str(tmp_path / source)
    ports = [str(free_port()) for _ in range(4)]
    result = _run("--role", role, "--model", source, "--host", "127.0.0.1", "--device", "cpu",
                  "--http-port", ports[0], "--grpc-port", ports[1], "--transfer-port", ports[2],
                  "--admin-port", ports[3], "--insecure")
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
    assert "Started server process" not in result.stderr


@pytest.mark.parametrize(("flags", "words"), [
    (("--advertise-host", "bad host!"), "--advertise-host 'bad host!' is not an IPv4 address"),
    (("--host", "::1"), "--host '::1' is not an IPv4 address")])
def test_a_pd_worker_that_cannot_name_itself_by_an_ipv4_address_fails_before_loading(
        flags: tuple[str, ...], words: str) -> None:
    """xLLM's cluster_id packs an IPv4 address: this failed once the model had loaded."""
    result = _run("--role", "prefill", "--insecure", "--model", "x", *flags)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr
    assert _configs("--role", "prefill", "--insecure", "--model", "x", "--host", "localhost")[1].instance_name \
        == "127.0.0.1:7777", "a name is resolved once"


def test_metrics_carry_every_contract_name(served: Any) -> None:
    text = httpx.get(f"{served.base_url}/metrics", timeout=10.0).text
    names = [
        "disagg_time_to_first_token_seconds_bucket", "disagg_time_per_output_token_seconds_bucket",
        "disagg_e2e_request_latency_seconds_bucket", "disagg_kv_transfer_seconds_bucket",
        "disagg_requests_total", "disagg_kv_transfer_bytes_total", "disagg_prompt_tokens_total",
        "disagg_generation_tokens_total", "disagg_kv_blocks_total", "disagg_kv_blocks_free",
        "disagg_requests_running", "disagg_requests_waiting", "disagg_links", "disagg_draining",
    ]
    missing = [n for n in names if f"\n# TYPE {n.removesuffix('_bucket')}" not in text and f"\n{n}" not in text]
    assert not missing, missing
    assert 'disagg_requests_total{role="mixed",status="ok"}' in text
    assert 'python_gc_collections_total{generation="2"}' in text and "process_cpu_seconds_total" in text


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 2), (16, 16), (0, 1)])
def test_default_threads_are_the_usable_cpus(monkeypatch: pytest.MonkeyPatch, cpus: int, threads: int) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads(cpus) == threads


def test_default_threads_follow_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == usable_cpus()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    for bad in ("many", "0"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            default_threads()


PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
SPINS = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": cli.OWNED_CPUS_SPIN_COUNT}
SPINS_BRIEFLY = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": cli.TURN_SPIN_COUNT}


@pytest.mark.parametrize(("given", "argv", "expected"), [
    ({}, [], PASSIVE),
    ({}, ["serve", "--role", "prefill"], PASSIVE),
    ({}, ["serve", "--role", "decode"], PASSIVE),
    ({}, ["serve", "--role", "mixed"], SPINS),  # a mixed worker owns its CPUs
    ({}, ["serve", "--role=mixed", "--model", "x"], SPINS),
    ({}, ["serve", "--role", "mixed", "--cpu-turn-dir", "/tmp/t"], SPINS_BRIEFLY),  # it shares them, taking turns
    ({}, ["serve", "--role", "prefill", "--cpu-turn-dir=/tmp/t"], SPINS_BRIEFLY),
    ({}, ["serve", "--role", "decode", "--cpu-turn-dir", "/tmp/t"], SPINS_BRIEFLY),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, ["serve", "--role", "decode"], {"OMP_WAIT_POLICY": "ACTIVE"}),
    ({"GOMP_SPINCOUNT": "300000"}, ["serve", "--role", "mixed"], {"GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": None}),
])
def test_the_cli_sets_how_openmp_waits_unless_told(monkeypatch: pytest.MonkeyPatch, capsys: Any,
                                                   given: dict[str, str], argv: list[str],
                                                   expected: dict[str, str | None]) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    with contextlib.suppress(SystemExit):  # the parser refuses --bogus; the policy was set before it parsed
        cli.main([*argv, "--bogus"])
    assert {name: os.environ.get(name) for name in expected} == expected


def test_threads_reach_torch(served: Any, worker_launcher: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    # `served` runs with OMP_NUM_THREADS=1; --threads wins over it.
    assert "compute threads: 1 (inter-op: 1)" in served.log()
    with worker_launcher(str(tiny_model_dir), tmp_path / "worker.log", "--threads", "3") as worker:
        assert "compute threads: 3 (inter-op: 1)" in worker.log()


def test_each_worker_of_a_local_pair_takes_every_cpu(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with running_pair(str(tiny_model_dir), tmp_path, ["--device", "cpu"], 180.0) as workers:
        for worker in workers:
            assert f"compute threads: {usable_cpus()} (inter-op: 1)" in worker.log(), worker.log()[-2000:]


class _Cycle:
    """An object in a reference cycle: only the cyclic collector can free it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Give the frozen objects back to the collector after the test (this process goes on testing)."""
    yield
    gc.unfreeze()


def test_freezing_collects_start_up_garbage_first(unfrozen: None) -> None:
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage
    kept = _Cycle()
    frozen = freeze_startup_heap()
    assert gone() is None, "a cycle that was already garbage must be freed, not frozen for good"
    # The count only falls after this (frozen objects still die by reference counting, also on other threads).
    assert frozen > 0 and gc.get_freeze_count() <= frozen
    assert all(obj is not kept for obj in gc.get_objects()), "a live object leaves the collected generations"


def test_a_started_worker_freezes_its_start_up_heap(served: Any) -> None:
    match = re.search(r"\((\d+) start-up objects frozen", served.log())
    assert match, served.log()[-2000:]
    assert int(match.group(1)) > 10_000  # torch, gRPC, FastAPI and the model: far more than this


def test_a_worker_bound_to_its_pod_address_listens_on_loopback_too() -> None:
    """kubectl port-forward connects to localhost inside the pod; the operator binds workers to the
    pod's IP. (Only the loopback side is bound here: tests use loopback addresses only.)"""
    port = free_port()
    sock = loopback_listener("10.244.1.7", port)  # a pod's address
    assert sock is not None
    try:
        assert sock.getsockname() == ("127.0.0.1", port)
        sock.listen()  # as uvicorn's server does
        assert loopback_listener("10.244.1.7", port) is None  # taken: best effort, no failure
    finally:
        sock.close()
    for host in ("127.0.0.5", "0.0.0.0", "localhost", "::1"):  # loopback or every address already
        assert loopback_listener(host, port) is None, host


def test_a_host_name_listens_as_uvicorn_would() -> None:
    """Bound before anything starts, as uvicorn binds: "localhost" on IPv4 (where clients of 127.0.0.1 are)."""
    port = free_port()
    sockets = listening_sockets("localhost", port)
    try:
        assert [s.getsockname() for s in sockets] == [("127.0.0.1", port)]
    finally:
        for s in sockets:
            s.close()
