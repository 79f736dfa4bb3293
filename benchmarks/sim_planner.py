"""Trace-driven simulation of the autoscaling policies on profiled per-pod curves (a script, not a test).

This machine's 2 cores give more pods no real capacity, so the autoscaler is
judged here, on curves measured on the real engine by
`benchmarks/profile_roles.py`:
- a prefill pod is a FIFO server: a request starts when the pod has finished
  the previous prompts at the pod's saturated rate (prompt tokens/s of the
  profile's largest batch) and gets its first token after the batch-1 TTFT of
  its length (a least-squares line over the profile's lengths);
- a decode pod shares each step among its running sequences: a step takes
  TPOT(b) for b running sequences (the profile's curve, made non-decreasing,
  linear between and beyond the points); it holds at most max_num_seqs
  sequences and a fixed KV pool;
- as in the real system (workers/pd/prefill.py), a request first reserves a
  decode slot with its prompt's KV blocks (AddNewRequests; refused, it waits
  and retries), then queues on the least-busy prefill; the rest of its KV is
  taken when it starts decoding. Its TTFT counts both waits. The metrics are
  reported as the workers report theirs (see `Cluster.metrics`).
Scale-up: a new pod serves STARTUP_S (or --startup-s) after the decision (the
assumption: pod start, model load from the node's cache, link). Scale-down drains: the pod
takes no new request, finishes what it has, then goes; it costs until then.

Policies, side by side on the same traces: static (peak and average
provisioning, from the trace's own 60 s demand), per-role HPA-style (the
Kubernetes HPA formula on each role's own requests in flight, no ratio), and ours
(`disagg.operator.autoscaler.decide` with the spec parsed by
`disagg.operator.scaling.parse_scaling`, every 15 s, on a 30 s metrics window).

    .venv/bin/python benchmarks/sim_planner.py [--profile benchmarks/profiles/tiny-llama-cpu.json] [--seed 0]
                                               [--startup-s 30] [--control-s 15]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.operator.autoscaler import AutoscalerState, RoleInput, RoleMetrics, decide
from disagg.operator.scaling import ROLES, Role, ScalingSpec, parse_scaling

PROFILE = Path(__file__).parent / "profiles" / "tiny-llama-cpu.json"
# Decision to serving: the real harness measured 19.8 s from a load step to a new pod linked and
# serving with the tests' tiny model; the builtin model's worker is ready 24 s after its exec on
# this (busy) machine, once its conversion is cached. 30 s covers pod start, load and link.
STARTUP_S = 30.0
CONTROL_S = 15.0  # the operator's pass (DISAGG_OPERATOR_AUTOSCALER_INTERVAL_S's default)
WINDOW_S = 30.0  # the metrics window the operator summarises
DURATION_S = 1800.0
BLOCK_SIZE = 16
KV_BLOCKS = 64 * 128  # per decode pod: 64 sequences of 2048 tokens
MAX_PODS = 32  # per role, for the scalers
UTILISATION = 0.8  # static provisioning plans for the same headroom as the autoscaler's load floor


# --- the profile's curves ------------------------------------------------------------


@dataclass(frozen=True)
class Curves:
    overhead_s: float  # batch-1 TTFT = overhead_s + prompt_len * per_token_s
    per_token_s: float
    prefill_tokens_per_s: float  # a pod's saturated prompt throughput
    batches: tuple[int, ...]
    tpots: tuple[float, ...]  # non-decreasing in the batch
    max_num_seqs: int

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any]) -> Curves:
        ones = [(r["prompt_len"], r["ttft_mean_s"]) for r in profile["prefill"] if r["batch"] == 1]
        mx, my = sum(x for x, _ in ones) / len(ones), sum(y for _, y in ones) / len(ones)
        slope = sum((x - mx) * (y - my) for x, y in ones) / sum((x - mx) ** 2 for x, _ in ones)
        slope = max(slope, 1e-7)
        biggest = max(r["batch"] for r in profile["prefill"])
        rates = sorted(r["prompt_tokens_per_s"] for r in profile["prefill"] if r["batch"] == biggest)
        rows = sorted(profile["decode"], key=lambda r: r["batch"])
        tpots = list(itertools.accumulate((r["tpot_mean_s"] for r in rows), max))  # noise never makes a batch faster
        return cls(max(my - slope * mx, 0.0), slope, rates[len(rates) // 2], tuple(r["batch"] for r in rows),
                   tuple(tpots), int(profile["max_num_seqs"]))

    def ttft_alone(self, prompt_len: int) -> float:
        return self.overhead_s + prompt_len * self.per_token_s

    def tpot(self, batch: int) -> float:
        b, t = self.batches, self.tpots
        i = min(max(bisect.bisect_left(b, batch), 1), len(b) - 1)
        return max(t[0], t[i - 1] + (t[i] - t[i - 1]) * (batch - b[i - 1]) / (b[i] - b[i - 1]))

    def sequences_within(self, tpot_target_s: float) -> int:
        """The most running sequences a decode pod holds within the TPOT target."""
        return max([b for b in range(1, self.max_num_seqs + 1) if self.tpot(b) <= tpot_target_s] or [1])


# --- workloads ----------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    arrival: float
    prompt_len: int
    output_len: int


Shape = Callable[[float], tuple[float, int, int]]  # time -> (arrivals/s, mean prompt, mean output)


def trace(shape: Shape, seed: int) -> list[Request]:
    """Poisson arrivals at the shape's rate (thinning), lengths uniform within ±50% of its means."""
    rng = random.Random(seed)
    peak = max(shape(t)[0] for t in range(int(DURATION_S)))
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= DURATION_S:
            return out
        rate, prompt, output = shape(t)
        if rng.random() < rate / peak:
            out.append(Request(t, rng.randint(prompt // 2, prompt * 3 // 2), rng.randint(output // 2, output * 3 // 2)))


def workloads(peak: float) -> dict[str, Shape]:
    """Peak `peak` arrivals/s; a balanced mix of 512 prompt and 256 output tokens."""
    def burst(t: float) -> bool:
        return 600 <= t < 1200
    return {
        "diurnal ramp": lambda t: (peak * (0.2 + 0.8 * math.sin(math.pi * t / DURATION_S) ** 2), 512, 256),
        "prompt-heavy burst": lambda t: (peak * 0.5, 2048, 64) if burst(t) else (peak * 0.5, 512, 256),
        "generation-heavy burst": lambda t: (peak * 0.5, 128, 768) if burst(t) else (peak * 0.5, 512, 256),
        "flash crowd": lambda t: (peak if 600 <= t < 900 else peak * 0.3, 512, 256),
    }


# --- the cluster ----------------------------------------------------------------------


@dataclass(eq=False)
class Pod:
    role: Role
    ready_at: float
    created: float
    removed: float | None = None
    draining: bool = False
    # prefill: FIFO server
    free_at: float = 0.0
    queued: deque[tuple[float, float]] = field(default_factory=deque)  # (start, first token) of its requests
    # decode: every running sequence advances 1/TPOT(b) tokens per second
    progress: float = 0.0  # tokens each running sequence has made since the pod started
    last: float = 0.0
    running: dict[int, tuple[float, Request]] = field(default_factory=dict)  # id -> (progress at start, request)
    ends: list[tuple[float, int]] = field(default_factory=list)  # heap of (progress at end, id)
    reserved: dict[int, Request] = field(default_factory=dict)  # slots held for requests still in prefill
    kv_used: int = 0  # blocks held by running and reserved sequences
    version: int = 0

    def is_open(self, now: float) -> bool:
        return self.removed is None and not self.draining and self.ready_at <= now

    @property
    def num_slots_used(self) -> int:
        return len(self.running) + len(self.reserved)


def kv_blocks(req: Request, tokens: int | None = None) -> int:
    """Blocks `tokens` of the sequence take (all of it by default): a reservation takes the
    prompt's (as `AddNewRequests` does), the rest is taken when decoding starts."""
    return -(-(req.prompt_len + req.output_len if tokens is None else tokens) // BLOCK_SIZE)


@dataclass
class Outcome:
    ttft: float | None = None
    tpot: float | None = None


Policy = Callable[[float, Mapping[Role, int], Mapping[Role, RoleMetrics]], Mapping[Role, int]]


class Cluster:
    def __init__(self, curves: Curves, counts: Mapping[Role, int], startup_s: float = STARTUP_S,
                 control_s: float = CONTROL_S) -> None:
        self.c = curves
        self.startup_s = startup_s
        self.control_s = control_s
        self.pods: dict[Role, list[Pod]] = {r: [Pod(r, 0.0, 0.0) for _ in range(counts[r])] for r in ROLES}
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.queue: deque[tuple[int, Request]] = deque()
        self.outcomes: dict[int, Outcome] = {}
        self.ttfts: deque[tuple[float, float]] = deque()  # (time, TTFT) of recent first tokens
        self.tpots: deque[tuple[float, float]] = deque()
        self.started: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, output tokens) into service
        self.actions = 0
        self.peak = {r: counts[r] for r in ROLES}

    def at(self, when: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    # decode pods: virtual progress, rescheduled whenever the batch changes
    def _advance(self, pod: Pod, now: float) -> None:
        if pod.running:
            pod.progress += (now - pod.last) / self.c.tpot(len(pod.running))
        pod.last = now

    def _reschedule(self, pod: Pod, now: float) -> None:
        pod.version += 1
        if pod.ends:
            left = pod.ends[0][0] - pod.progress
            self.at(now + max(left, 0.0) * self.c.tpot(len(pod.running)), "decode", (pod, pod.version))

    def admit(self, now: float) -> None:
        """Queued requests reserve a decode slot, then queue on the least-busy prefill."""
        while self.queue:
            rid, req = self.queue[0]
            blocks = kv_blocks(req, req.prompt_len)
            decodes = [p for p in self.pods["decode"] if p.is_open(now) and p.num_slots_used < self.c.max_num_seqs
                       and p.kv_used + blocks <= KV_BLOCKS]
            prefills = [p for p in self.pods["prefill"] if p.is_open(now)]
            if not decodes or not prefills:
                return
            self.queue.popleft()
            decode = min(decodes, key=lambda p: p.num_slots_used)
            prefill = min(prefills, key=lambda p: p.free_at)
            decode.reserved[rid] = req
            decode.kv_used += blocks
            start = max(now, prefill.free_at)
            prefill.free_at = start + req.prompt_len / self.c.prefill_tokens_per_s
            first = start + self.c.ttft_alone(req.prompt_len)
            prefill.queued.append((start, first))
            self.started.append((now, req.prompt_len, req.output_len))
            self.at(first, "first", (rid, req, prefill, decode))

    def on_first(self, now: float, rid: int, req: Request, prefill: Pod, decode: Pod) -> None:
        prefill.queued.popleft()
        self.outcomes[rid].ttft = now - req.arrival
        self.ttfts.append((now, now - req.arrival))
        del decode.reserved[rid]
        decode.kv_used += kv_blocks(req) - kv_blocks(req, req.prompt_len)  # may overcommit, as preemption would
        self._advance(decode, now)
        decode.running[rid] = (decode.progress, req)
        heapq.heappush(decode.ends, (decode.progress + max(req.output_len - 1, 0), rid))
        self._reschedule(decode, now)
        self._maybe_remove(prefill, now)

    def on_decode(self, now: float, pod: Pod, version: int) -> None:
        if version != pod.version:
            return  # the batch changed since this was scheduled
        self._advance(pod, now)
        while pod.ends and pod.ends[0][0] <= pod.progress + 1e-9:
            _, rid = heapq.heappop(pod.ends)
            _, req = pod.running.pop(rid)
            first = self.outcomes[rid]
            assert first.ttft is not None
            tpot = (now - (req.arrival + first.ttft)) / max(req.output_len - 1, 1)
            first.tpot = tpot
            pod.kv_used -= kv_blocks(req)
            self.tpots.append((now, tpot))
        self._reschedule(pod, now)
        self._maybe_remove(pod, now)
        self.admit(now)

    def _maybe_remove(self, pod: Pod, now: float) -> None:
        if pod.draining and pod.removed is None and not pod.queued and not pod.running and not pod.reserved:
            pod.removed = now

    # metrics, as the operator would summarise the workers' /metrics
    def metrics(self, now: float) -> dict[Role, RoleMetrics]:
        for log in (self.ttfts, self.tpots, self.started):
            while log and log[0][0] < now - WINDOW_S:
                log.popleft()
        prefills = [p for p in self.pods["prefill"] if p.removed is None and p.ready_at <= now]
        decodes = [p for p in self.pods["decode"] if p.removed is None and p.ready_at <= now]
        queued = sum(1 for p in prefills for start, _ in p.queued if start > now)
        in_pods = sum(len(p.queued) for p in prefills)

        def p90(log: deque[tuple[float, float]]) -> float | None:
            values = sorted(v for _, v in log)
            return values[int(0.9 * (len(values) - 1))] if values else None

        prompt_rate = sum(n for _, n, _ in self.started) / WINDOW_S
        gen_rate = sum(n for _, _, n in self.started) / WINDOW_S
        used = sum(p.kv_used for p in decodes)
        return {
            # As the workers report them (workers/pd): a prefill's waiting is its engine's queue, its
            # running every other request it holds (prefilling, retrying AddNewRequests, decoding on
            # a decode); a decode's waiting is its reservations still waiting for their KV.
            "prefill": RoleMetrics(now, len(prefills), p90(self.ttfts), None, queued,
                                   in_pods - queued + len(self.queue) + sum(len(p.running) for p in decodes),
                                   0, 0, prompt_rate, gen_rate),
            "decode": RoleMetrics(now, len(decodes), None, p90(self.tpots), sum(len(p.reserved) for p in decodes),
                                  sum(len(p.running) for p in decodes), max(len(decodes) * KV_BLOCKS - used, 0),
                                  len(decodes) * KV_BLOCKS, prompt_rate, gen_rate),
        }

    def scale(self, now: float, role: Role, desired: int) -> None:
        live = [p for p in self.pods[role] if p.removed is None and not p.draining]
        if desired != len(live):
            self.actions += 1
        for _ in range(desired - len(live)):
            self.pods[role].append(Pod(role, now + self.startup_s, now, last=now))
            self.at(now + self.startup_s, "ready")
        # Fewer: starting pods are cancelled first, then the least busy drain.
        for pod in sorted(live, key=lambda p: (p.ready_at <= now, len(p.queued) + p.num_slots_used))[
                :max(len(live) - desired, 0)]:
            pod.draining = True
            if pod.ready_at > now:
                pod.removed = now
            self._maybe_remove(pod, now)
        self.peak[role] = max(self.peak[role], sum(1 for p in self.pods[role] if p.removed is None))

    def run(self, requests: Sequence[Request], policy: Policy | None) -> None:
        for rid, req in enumerate(requests):
            self.outcomes[rid] = Outcome()
            self.at(req.arrival, "arrive", (rid, req))
        if policy is not None:
            for k in range(1, int(DURATION_S / self.control_s) + 1):
                self.at(k * self.control_s, "control")
        end = DURATION_S + 600  # the tail: requests still in flight finish, or count as missed
        while self.events and self.events[0][0] <= end:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.queue.append(payload)
                self.admit(now)
            elif kind == "first":
                self.on_first(now, *payload)
            elif kind == "decode":
                self.on_decode(now, *payload)
            elif kind == "ready":
                self.admit(now)
            elif kind == "control" and policy is not None:
                counts = {r: sum(1 for p in self.pods[r] if p.removed is None and not p.draining) for r in ROLES}
                for role, n in policy(now, counts, self.metrics(now)).items():
                    self.scale(now, role, n)

    def pod_seconds(self) -> float:
        return sum(min(p.removed if p.removed is not None else DURATION_S, DURATION_S) - min(p.created, DURATION_S)
                   for pods in self.pods.values() for p in pods)


# --- policies -------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    curves: Curves
    ttft_target_s: float
    tpot_target_s: float

    @property
    def sequences_per_pod(self) -> int:
        return self.curves.sequences_within(self.tpot_target_s)

    def demand(self, requests: Sequence[Request]) -> list[dict[Role, float]]:
        """Pods each role needs, per 60 s of the trace, at UTILISATION of their capacity."""
        out: list[dict[Role, float]] = []
        for k in range(int(DURATION_S // 60)):
            window = [r for r in requests if k * 60 <= r.arrival < (k + 1) * 60]
            prompt_rate = sum(r.prompt_len for r in window) / 60
            # Little's law: running sequences = arrivals/s x output tokens x TPOT
            concurrency = sum(r.output_len for r in window) / 60 * self.tpot_target_s
            out.append({"prefill": prompt_rate / (self.curves.prefill_tokens_per_s * UTILISATION),
                        "decode": concurrency / (self.sequences_per_pod * UTILISATION)})
        return out

    def spec(self) -> ScalingSpec:
        return parse_scaling({
            "ratio": {"minPrefillPerDecode": "0.25", "maxPrefillPerDecode": "2"},
            "autoscaler": {
                "prefill": {"minReplicas": 1, "maxReplicas": MAX_PODS,
                            "promptTokensPerSecondPerPod": self.curves.prefill_tokens_per_s},
                "decode": {"minReplicas": 1, "maxReplicas": MAX_PODS, "sequencesPerPod": self.sequences_per_pod},
                "targets": {"ttftP90Ms": max(1, round(self.ttft_target_s * 1000)),
                            "tpotP90Ms": max(1, round(self.tpot_target_s * 1000))},
                "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300, "maxStep": 4,
            },
        })


def ours(setup: Setup) -> Policy:
    spec = setup.spec()
    assert spec.autoscaler is not None
    auto = spec.autoscaler
    state = AutoscalerState()

    def policy(now: float, counts: Mapping[Role, int], m: Mapping[Role, RoleMetrics]) -> Mapping[Role, int]:
        nonlocal state
        d = decide(auto, spec.ratio, {r: RoleInput(counts[r], m[r]) for r in ROLES}, state, now)
        state = d.state
        return {r: d.roles[r].desired for r in ROLES}
    return policy


def hpa(setup: Setup, balanced_prompt: int, balanced_output: int) -> Policy:
    """The Kubernetes HPA formula per role: ceil(n x metric / target), ±10% tolerance, scale-up
    at most max(2n, n + 4) per pass, scale-down to the highest recommendation of 300 s.
    The metric is each role's requests in flight per pod (its running plus waiting, as the
    worker reports them); the target is what a pod holds at UTILISATION on the balanced mix
    (Little's law: a prefill holds its requests for their TTFT and their whole decode)."""
    c = setup.curves
    per_pod_rate = UTILISATION * c.prefill_tokens_per_s / balanced_prompt
    held_s = 2 * c.ttft_alone(balanced_prompt) + balanced_output * setup.tpot_target_s
    targets = {"prefill": per_pod_rate * held_s, "decode": UTILISATION * setup.sequences_per_pod}
    history: dict[Role, deque[tuple[float, int]]] = {r: deque() for r in ROLES}

    def policy(now: float, counts: Mapping[Role, int], m: Mapping[Role, RoleMetrics]) -> Mapping[Role, int]:
        out = {}
        for r in ROLES:
            n, mr = counts[r], m[r]
            if mr.pods_reporting == 0:
                out[r] = n
                continue
            ratio = (mr.requests_waiting + mr.requests_running) / mr.pods_reporting / targets[r]
            rec = n if abs(ratio - 1) <= 0.1 else max(1, min(MAX_PODS, math.ceil(mr.pods_reporting * ratio)))
            history[r].append((now, rec))
            while history[r][0][0] < now - 300:
                history[r].popleft()
            out[r] = min(rec, max(2 * n, n + 4)) if rec > n else min(n, max(v for _, v in history[r]))
        return out
    return policy


def static(counts: Mapping[Role, int]) -> Policy:
    return lambda now, current, m: counts


# --- the run --------------------------------------------------------------------------


def simulate(setup: Setup, requests: Sequence[Request], start: Mapping[Role, int],
             policy: Policy | None, startup_s: float = STARTUP_S, control_s: float = CONTROL_S) -> dict[str, float]:
    cluster = Cluster(setup.curves, start, startup_s, control_s)
    cluster.run(requests, policy)
    good = sum(1 for o in cluster.outcomes.values() if o.ttft is not None and o.tpot is not None
               and o.ttft <= setup.ttft_target_s and o.tpot <= setup.tpot_target_s)
    avg_pods = cluster.pod_seconds() / DURATION_S
    return {"attainment": good / len(requests), "goodput_per_pod": good / DURATION_S / avg_pods,
            "avg_pods": avg_pods, "peak_pods": sum(cluster.peak.values()), "actions": cluster.actions}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-s", type=float, default=STARTUP_S,
                        help="decision to a new pod serving (pod start, model load, link)")
    parser.add_argument("--control-s", type=float, default=CONTROL_S,
                        help="the scalers' pass (the operator's DISAGG_OPERATOR_AUTOSCALER_INTERVAL_S)")
    parser.add_argument("--peak-decode-pods", type=float, default=8.0,
                        help="the balanced mix's peak load, in decode pods at full utilisation")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    curves = Curves.from_profile(json.loads(args.profile.read_text()))
    # Targets from the profile: TTFT twice a lone longest prompt's (3072 tokens, the prompt-heavy
    # burst's longest); TPOT 10% over a 32-sequence batch's.
    setup = Setup(curves, 2 * curves.ttft_alone(3072), 1.1 * curves.tpot(32))
    peak = args.peak_decode_pods * setup.sequences_per_pod / (256 * setup.tpot_target_s)
    print(f"profile {args.profile.name}: prefill {curves.prefill_tokens_per_s:.0f} prompt tok/s per pod, "
          f"TTFT alone {curves.overhead_s * 1000:.1f} ms + {curves.per_token_s * 1e6:.1f} us/token; decode TPOT "
          f"{curves.tpot(1) * 1000:.1f} ms at 1 to {curves.tpot(curves.max_num_seqs) * 1000:.1f} ms at "
          f"{curves.max_num_seqs}\ntargets: p90 TTFT {setup.ttft_target_s * 1000:.0f} ms, TPOT "
          f"{setup.tpot_target_s * 1000:.1f} ms ({setup.sequences_per_pod} sequences per decode pod); "
          f"peak {peak:.1f} req/s; pod start-up {args.startup_s:.0f} s; control every {args.control_s:.0f} s\n")
    print("| workload | policy | SLO attainment | goodput/pod (req/s) | avg pods | peak pods | scale actions |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in workloads(peak).items():
        requests = trace(shape, args.seed)
        demand = setup.demand(requests)
        top = {r: max(1, math.ceil(max(d[r] for d in demand))) for r in ROLES}
        mean = {r: max(1, math.ceil(sum(d[r] for d in demand) / len(demand))) for r in ROLES}
        low = {r: max(1, math.ceil(demand[0][r])) for r in ROLES}
        policies: list[tuple[str, Mapping[Role, int], Policy | None]] = [
            (f"static peak {top['prefill']}P:{top['decode']}D", top, None),
            (f"static average {mean['prefill']}P:{mean['decode']}D", mean, None),
            ("HPA-style per role", low, hpa(setup, 512, 256)),
            ("ours", low, ours(setup)),
        ]
        for label, start, policy in policies:
            f = simulate(setup, requests, start, policy, args.startup_s, args.control_s)
            print(f"| {name} | {label} | {f['attainment']:.1%} | {f['goodput_per_pod']:.2f} | {f['avg_pods']:.1f} "
                  f"| {f['peak_pods']:.0f} | {f['actions']:.0f} |", flush=True)
    print(f"\n{time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
