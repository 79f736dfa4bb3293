"""`disagg demo`: a prefill and a decode on this machine, linked, answering a
few chat prompts through the OpenAI API; then what happened (time to first
token, time per output token, KV bytes moved, from the workers' /metrics).

The workers are always stopped at the end, on an error or a Ctrl-C too;
`--serve` keeps them running for the user's own client until Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from dataclasses import dataclass
from pathlib import Path

import httpx

from disagg.proto.vocabulary import DTYPES
from disagg.workers.args import positive
from disagg.workers.config import default_threads
from disagg.workers.local import WorkerFailed, WorkerProcess, link, spawn_worker
from disagg.workers.security.key import ClusterKey

DEFAULT_MODEL = "builtin:smollm2-135m"
SERVED_NAME = "smollm2"
PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
)
_STOP_GRACE_S = 15.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) in the demo, raised by its own handler of both.

    Not a plain KeyboardInterrupt because CPython 3.11 marks one that escapes an
    `exec` of a string (dataclasses and namedtuples are made that way, by lazy
    imports too) as unhandled, and then exits by SIGINT even after we caught it.
    """


class _CtrlC:
    """The demo's SIGINT and SIGTERM handler: raises Interrupted at once, or at the end of a
    `deferred()` block, so a worker cannot be started and then lost to it (the
    signal may reach any thread; only the handler itself can hold it back). The workers
    run in process groups of their own, so the demo is what stops them on either signal."""

    def __init__(self) -> None:
        self._deferring = 0
        self._pending = False
        self.signum = signal.SIGINT  # the last one received: the exit code says which

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signal.Signals(signum)
        if self._deferring:
            self._pending = True
            return
        raise Interrupted()

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if self._pending and not self._deferring:
                self._pending = False
                raise Interrupted()


_CTRL_C = _CtrlC()


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model source (default %(default)s)")
    p.add_argument("--served-model-name", default=SERVED_NAME, help="the name clients send (default %(default)s)")
    p.add_argument("--max-tokens", type=positive(int), default=32, help="tokens per answer (default %(default)s)")
    p.add_argument("--kv-transfer-mode", choices=("PUSH", "PULL"), default="PUSH", help="default %(default)s")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default %(default)s")
    # The demo shows the model's own answers: fp32, whose greedy tokens equal transformers'. bf16 (`auto`
    # on a CPU with native bf16) is faster and within its tolerance, but flips near-ties: this model's
    # first answer token to the France question is "The" over "L" by 0.08 in fp32, and an AMX CPU's bf16
    # picks "L" (docs/benchmarks-engine.md, "bf16 on an AMX CPU").
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the workers' dtype (default %(default)s)")
    p.add_argument("--startup-timeout", type=positive(float), default=600.0,
                   help="seconds to wait for the workers to load the model (default %(default)s)")
    p.add_argument("--serve", action="store_true",
                   help="after the prompts, keep the workers running for your own client until Ctrl-C")
    p.add_argument("--log-dir", type=Path, default=None, help="where the workers' logs go (default: a temp folder)")
    p.add_argument("--cluster-key-file", type=Path, default=None, metavar="PATH",
                   help="the key the two workers share (default: a random one, made for this run in the log folder)")


@dataclass(frozen=True)
class Figures:
    """What the demo reports, from the workers' /metrics."""

    ttft_s: float | None  # mean time to first token
    tpot_s: float | None  # mean time per output token after the first
    kv_bytes_sent: float  # by the prefill
    kv_bytes_received: float  # by the decode

    @classmethod
    def read(cls, prefill: WorkerProcess, decode: WorkerProcess) -> Figures:
        return cls(
            ttft_s=_mean(prefill, "disagg_time_to_first_token_seconds"),
            tpot_s=_mean(prefill, "disagg_time_per_output_token_seconds"),
            kv_bytes_sent=prefill.metric("disagg_kv_transfer_bytes_total", direction="sent"),
            kv_bytes_received=decode.metric("disagg_kv_transfer_bytes_total", direction="received"),
        )


def _mean(worker: WorkerProcess, histogram: str) -> float | None:
    count = worker.metric(f"{histogram}_count")
    return worker.metric(f"{histogram}_sum") / count if count else None


@contextmanager
def running_pair(model: str, log_dir: Path, extra: list[str], startup_timeout_s: float,
                 mode: str = "PUSH", key_file: Path | None = None, cpu_turns: bool = True,
                 ) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """A prefill and a decode on loopback, loaded and linked, each with every CPU (see
    default_threads); both stopped on the way out, whatever happens.

    They share the key in `key_file`; None: a random one, written to `log_dir`.
    `cpu_turns`: they take turns on the cores they share (`--cpu-turn-dir`, a folder in `log_dir`).
    """
    turns = ["--cpu-turn-dir", str(log_dir / "cpu-turns")] if cpu_turns else []
    if key_file is None:
        log_dir.mkdir(parents=True, exist_ok=True)
        key_file = log_dir / "cluster.key"
        key_file.unlink(missing_ok=True)
        ClusterKey.generate().write(key_file)
    workers: list[WorkerProcess] = []
    threads = default_threads()
    try:
        for role in ("decode", "prefill"):
            with _CTRL_C.deferred():
                workers.append(spawn_worker(role, model, log_dir / f"{role}.log",
                                            ["--kv-transfer-mode", mode, *turns, *extra], key_file=key_file,
                                            threads=threads))
        decode, prefill = workers
        for w in workers:
            w.wait_loaded(startup_timeout_s)
        error = link(decode, prefill)
        if error is not None:
            raise WorkerFailed(f"linking decode {decode.instance_name} to prefill {prefill.instance_name}: {error}")
        _wait_ready(prefill, 30.0)
        yield prefill, decode
    finally:
        for w in reversed(workers):
            w.stop(_STOP_GRACE_S)


def _wait_ready(worker: WorkerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{worker.base_url}/ready", timeout=5.0).status_code != 200:
        if time.monotonic() > deadline:
            raise WorkerFailed(f"the {worker.role} was not ready {timeout_s:.0f} s after the link:\n{worker.log()}")
        time.sleep(0.1)


def _prepare_model(model: str) -> None:
    """Convert a GGUF source once, here, so the two workers do not both convert it."""
    from disagg.workers.engine.loader import ModelLoadError, default_cache_dir, resolve_model_dir

    try:
        resolve_model_dir(model, default_cache_dir())
    except ModelLoadError as exc:
        raise WorkerFailed(str(exc)) from exc


def run_demo(args: argparse.Namespace) -> int:
    import openai

    from disagg.workers.engine.loader import check_model_source

    try:
        check_model_source(args.model)
    except ValueError as exc:  # the loader's errors (ModelLoadError, ModelConfigError)
        print(f"disagg demo: {exc}", file=sys.stderr)
        return 2

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="disagg-demo-"))
    extra = ["--device", args.device, "--dtype", args.dtype, "--served-model-name", args.served_model_name,
             "--max-model-len", "1024"]
    print(f"disagg demo: {args.model}, one prefill and one decode on 127.0.0.1 (logs in {log_dir})", flush=True)
    previous = {sig: signal.signal(sig, _CTRL_C) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print("preparing the model (converted once, then cached in ~/.cache/disagg)...", flush=True)
        _prepare_model(args.model)
        print("starting the workers...", flush=True)
        with running_pair(args.model, log_dir, extra, args.startup_timeout, args.kv_transfer_mode,
                          args.cluster_key_file) as (prefill, decode):
            print(f"linked decode {decode.instance_name} to prefill {prefill.instance_name} "
                  f"({args.kv_transfer_mode}, tcp)\n", flush=True)
            _ask(prefill, args.served_model_name, args.max_tokens)
            _report(Figures.read(prefill, decode))
            if args.serve:
                _serve(prefill, args.served_model_name)
    except KeyboardInterrupt:
        print(f"\n{_CTRL_C.signum.name}: the workers were stopped", file=sys.stderr)
        return 128 + _CTRL_C.signum
    except (WorkerFailed, httpx.HTTPError, OSError, openai.APIError) as exc:  # e.g. --max-tokens past the context
        print(f"disagg demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _ask(prefill: WorkerProcess, model: str, max_tokens: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{prefill.base_url}/v1", api_key="unused", timeout=300.0, max_retries=0)
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
        )
        answer = (r.choices[0].message.content or "").strip()
        print(f"> {prompt}\n{answer}\n", flush=True)


def _report(f: Figures) -> None:
    def ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"

    print(f"time to first token (mean)  {ms(f.ttft_s)}")
    print(f"time per output token (mean) {ms(f.tpot_s)}")
    print(f"KV bytes moved: {f.kv_bytes_sent:,.0f} sent by the prefill, {f.kv_bytes_received:,.0f} received by the decode",
          flush=True)


def _serve(prefill: WorkerProcess, model: str) -> None:
    print(f"\nserving: the OpenAI API is at {prefill.base_url}/v1 (model {model!r}); Ctrl-C stops both workers.")
    print(f"  curl {prefill.base_url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
          flush=True)
    while prefill.process.poll() is None:
        time.sleep(0.5)
    raise WorkerFailed(f"the prefill exited with {prefill.process.returncode}:\n{prefill.log()}")
