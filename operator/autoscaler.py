"""The built-in SLO autoscaler: per-role metrics in, per-role desired counts out.

Pure: no Kubernetes, no I/O, no clock. The operator reads each pod's /metrics,
summarises a role's window into `RoleMetrics`, calls `decide` on every pass
with the previous `AutoscalerState`, writes the returned state back (status)
and scales to `RoleDecision.desired` through the same drain and unlink as a
manual scale-down. docs/autoscaling.md gives the algorithm and its reasons;
in short, per role:

1. Missing or stale metrics: hold, and say so (never act on a guess).
2. A raw recommendation from the role's signals: prefill follows prompt-token
   load, queued requests and p90 TTFT; decode follows running sequences, KV
   pressure and p90 TPOT, each read through the other role's state (`Coupling`:
   a prefill reserves its decode slot before its prompt queues). Up when any
   signal is over its band, down only when all are well under it, with
   projected values still safe (hysteresis).
3. Stabilisation windows, as the HPA does them: up to the lowest
   recommendation of the short up window, down to the highest of the long
   down window, and down only once the window is fully observed.
4. At most `max_step` pods per decision; within [minReplicas, maxReplicas];
   a role in a rollout is never shrunk.
Then the P:D ratio band (ratio.py) adjusts the pair.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from disagg.operator.ratio import Counts, apply_band
from disagg.operator.scaling import ROLES, AutoscalerSpec, RatioBand, Role

# Latency p90 / target: above UP_RATIO scale up, below DOWN_RATIO scale down may
# be considered, between them hold. The gap is the hysteresis band (AIBrix's
# ±10% tolerance on the way up; a wide margin on the way down because latency
# rises steeply, not linearly, once a pod saturates).
UP_RATIO = 1.1
DOWN_RATIO = 0.7
MAX_GAIN = 2.0  # one decision at most doubles a role on a latency signal (queues inflate p90 without bound)
UTILISATION = 0.8  # a pod's share of its profiled capacity the load floor plans for
DOWN_HEADROOM = 0.9  # scale down only to a count that leaves the load floor this margin (hysteresis)
KV_HIGH, KV_TARGET = 0.9, 0.75  # decode KV use: scale up above HIGH, to bring it back near TARGET
QUEUE_HIGH = 1.0  # prefill requests waiting per pod that calls for another pod

Outcome = Literal["scale-up", "scale-down", "hold"]
# Why a decision held; the operator puts these in its condition and metric labels.
HOLD_STEADY = "steady"
HOLD_MISSING = "metrics-missing"
HOLD_STALE = "metrics-stale"
HOLD_STABILISING = "stabilising"
HOLD_ROLLOUT = "rollout-in-progress"


@dataclass(frozen=True)
class RoleMetrics:
    """A role's worker metrics over one window, from the pods' own /metrics.

    Sums are over the pods that reported; quantiles are of the role's
    histograms merged over the window (`disagg_time_to_first_token_seconds`,
    `disagg_time_per_output_token_seconds`); rates are counter increases over
    the window (`disagg_prompt_tokens`, `disagg_generation_tokens`).
    """

    scraped_at: float  # the oldest of the pods' scrape times, on the caller's clock (s)
    pods_reporting: int
    ttft_p90_s: float | None  # None: no first token in the window (no traffic)
    tpot_p90_s: float | None
    requests_waiting: int  # prefill: in its own queue; decode: waiting for a decode slot or for its KV
    requests_running: int
    kv_blocks_free: int
    kv_blocks_total: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float

    def __post_init__(self) -> None:
        if min(self.pods_reporting, self.requests_waiting, self.requests_running, self.kv_blocks_free) < 0:
            raise ValueError(f"negative count in {self}")
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError(f"{self.kv_blocks_free} free KV blocks of {self.kv_blocks_total}")

    @property
    def kv_used_fraction(self) -> float:
        return 1 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class RoleInput:
    replicas: int  # the role's current count (the DisaggRole's spec.replicas)
    metrics: RoleMetrics | None  # None: no pod could be read
    rollout_in_progress: bool = False


@dataclass(frozen=True)
class RoleState:
    """What a role's decisions remember: raw recommendations inside the longest window."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time, raw recommendation)
    observed_since: float | None = None  # first time of the unbroken run of fresh metrics
    waiting: int | None = None  # requests waiting at the last fresh pass
    last_scale_time: float | None = None


@dataclass(frozen=True)
class AutoscalerState:
    roles: Mapping[Role, RoleState] = field(default_factory=lambda: {r: RoleState() for r in ROLES})


@dataclass(frozen=True)
class RoleDecision:
    current: int
    desired: int
    recommendation: int | None  # the raw one, before windows, step and band; None when held on metrics
    outcome: Outcome
    hold: str | None  # one of HOLD_*, when the role's own signals did not move it
    reason: str

    @property
    def acted(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class Decision:
    roles: Mapping[Role, RoleDecision]
    band_reason: str | None  # the P:D band's adjustment, or why it could not apply
    state: AutoscalerState


# --- step 2: one role's raw recommendation ------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


@dataclass(frozen=True)
class Recommendation:
    count: int
    reason: str
    signal: Literal["latency", "queue", "kv", "load", "down", "steady"]


@dataclass(frozen=True)
class Coupling:
    """What one role's signals mean depends on the other: a prefill reserves its decode slot
    (AddNewRequests, with the prompt's KV blocks) before it queues the prompt.

    - `prefill_in_flight` (for decode): the requests the prefills hold, their running plus
      waiting (none while their queue is over its band: then they all wait on prefill, those
      refused a slot too, as the slots are held by the queue's reservations). Each needs a decode slot, so the decode's load is at least that; the excess
      over the decode's own running plus waiting is the requests still retrying
      AddNewRequests, a demand the decode's own metrics cannot see.
    - `prefill_queued` (for decode): the prefills' own queue is over its band, so the
      decode's reservations (its waiting) and the KV they hold wait on prefill: the decode
      is judged on its running sequences and TPOT alone.
    - `decode_short` (for prefill): the decode side asks for more pods, so a prefill's TTFT
      includes the wait for a decode slot and says nothing about prefill; its own queue and
      load still do.
    - `decode_growth` (for prefill): the decode's desired count over its pods serving, while it is
      short. A prefill admits a prompt only once a decode slot is reserved, so its prompt-token
      rate is what the decode lets through; that rate grows with the decode, and the prefill
      plans for it now rather than one start-up later.
    """

    prefill_in_flight: int = 0
    prefill_queued: bool = False
    decode_short: bool = False
    decode_growth: float = 1.0


def recommend(role: Role, spec: AutoscalerSpec, m: RoleMetrics, current: int,
              coupling: Coupling = Coupling(), waiting_before: int | None = None) -> Recommendation:
    """The count the role's signals ask for right now, with the signal that decided it.

    `waiting_before` (prefill): the queue at the last pass. A backlog that has at
    least halved since is draining: the pods that serve outpace the arrivals, and
    the window's p90 TTFT is the backlog's tail, not the present; neither latency
    nor queue asks for pods then (new ones would serve after it drained).

    Latency, queue and KV signals scale the pods that serve (`pods_reporting`);
    pods still starting count towards that, so a pass made while they start
    does not ask again for what is already coming.
    """
    n = m.pods_reporting
    settled = n >= current  # no pod is starting: a breach needs at least one more
    target = spec.target_s(role)
    p90 = m.ttft_p90_s if role == "prefill" else m.tpot_p90_s
    latency = (p90 or 0.0) / target  # no samples in the window: no traffic, no latency pressure
    name = "TTFT" if role == "prefill" else "TPOT"
    capacity = spec.bounds[role].capacity_per_pod
    own = m.requests_running if coupling.prefill_queued else m.requests_running + m.requests_waiting
    # Requests the prefills hold beyond the decode's own count wait for a slot: a backlog that the
    # pods already serving drain too, so it at most doubles what the decode plans for in one pass.
    load = m.prompt_tokens_per_s * min(coupling.decode_growth, MAX_GAIN) if role == "prefill" else float(
        max(own, min(coupling.prefill_in_flight, MAX_GAIN * max(own, 1))))
    kv_used = 0.0 if coupling.prefill_queued else m.kv_used_fraction
    unit = "prompt tokens/s" if role == "prefill" else "sequences"
    floor = math.ceil(load / (capacity * UTILISATION)) if capacity else 0

    def more(count: int) -> int:
        return max(count, current + 1) if settled else count

    up: list[Recommendation] = []
    ttft_waits_on_decode = role == "prefill" and coupling.decode_short
    draining = (role == "prefill" and waiting_before is not None and waiting_before > QUEUE_HIGH * n
                and 2 * m.requests_waiting <= waiting_before)
    # A prefill with nothing queued is not what holds its TTFT up: the window's tail is a backlog
    # already served, or the wait for a decode slot.
    idle_queue = role == "prefill" and m.requests_waiting == 0
    if latency > UP_RATIO and not ttft_waits_on_decode and not draining and not idle_queue:
        up.append(Recommendation(more(math.ceil(n * min(latency, MAX_GAIN))),
                                 f"p90 {name} {_ms(p90 or 0)} is over the target {_ms(target)}", "latency"))
    if role == "prefill" and m.requests_waiting > QUEUE_HIGH * n and not draining:
        up.append(Recommendation(more(math.ceil(n * min(m.requests_waiting / (QUEUE_HIGH * n), MAX_GAIN))),
                                 f"{m.requests_waiting} requests wait on {n} prefill pods", "queue"))
    if role == "decode" and kv_used > KV_HIGH:
        up.append(Recommendation(more(math.ceil(n * kv_used / KV_TARGET)), f"KV cache {kv_used:.0%} used", "kv"))
    if floor > current:
        up.append(Recommendation(floor, f"{load:.0f} {unit} need {floor} pods at {capacity:g} per pod", "load"))
    best = max(up, key=lambda r: r.count, default=None)
    if best is not None and best.count > current:
        return best

    # Down only when every signal is well under its band, and still safe on fewer pods.
    within = f"p90 {name} {_ms(p90 or 0)} against the target {_ms(target)}: " + (
        "within the band" if latency <= UP_RATIO and not draining
        else f"a backlog drains ({waiting_before} -> {m.requests_waiting} waiting)" if draining
        else "it waits on decode" if ttft_waits_on_decode
        else "no request waits for a prefill (the window's tail is served)")
    # With a profiled capacity, the load decides how few pods suffice (latency does not shrink
    # in proportion to load: a pod's TPOT has a floor at batch 1) and latency only has to be
    # within its target; without one, latency must be well under it and is projected linearly.
    busy = (latency >= (1.0 if capacity else DOWN_RATIO) or kv_used >= KV_TARGET or best is not None
            or (role == "prefill" and m.requests_waiting > 0))
    if busy or current <= 1 or not settled:
        return Recommendation(current, within, "steady")
    down_floor = math.ceil(load / (capacity * UTILISATION * DOWN_HEADROOM)) if capacity else 0
    for fewer in range(max(down_floor, 1), current):
        scale = n / fewer  # each remaining pod takes this much more
        if (capacity or latency * scale <= 1.0) and kv_used * scale <= KV_TARGET:
            return Recommendation(fewer, f"p90 {name} {_ms(p90 or 0)} and {load:.0f} {unit} fit on {fewer} pods "
                                         f"(target {_ms(target)})", "down")
    return Recommendation(current, f"p90 {name} {_ms(p90 or 0)}: one pod fewer would breach the target "
                                   f"{_ms(target)}", "steady")


# --- steps 1, 3 and 4: one role's decision --------------------------------------


def _fresh(m: RoleMetrics | None, spec: AutoscalerSpec, now: float) -> str | None:
    """None when the metrics can be acted on, else the hold's reason."""
    if m is None or m.pods_reporting == 0:
        return HOLD_MISSING
    if now - m.scraped_at > spec.metrics_max_age_s:
        return HOLD_STALE
    return None


def _decide_role(role: Role, spec: AutoscalerSpec, inp: RoleInput, rec: Recommendation | None, st: RoleState,
                 now: float) -> tuple[RoleDecision, RoleState]:
    bounds = spec.bounds[role]
    current = inp.replicas
    clamped = min(max(current, bounds.min_replicas), bounds.max_replicas)
    stale = _fresh(inp.metrics, spec, now)
    if stale is not None or rec is None:
        stale = stale or HOLD_MISSING
        age = "no pod answered" if stale == HOLD_MISSING else (
            f"the oldest scrape is {now - inp.metrics.scraped_at:.0f} s old" if inp.metrics else "")
        # A gap forgets the run of observations: scale-down waits a full window again.
        return (RoleDecision(current, clamped, None, _outcome(current, clamped), stale,
                             f"holding: {role} metrics {stale.split('-')[1]} ({age})"),
                replace(st, recommendations=(), observed_since=None, waiting=None))
    raw, why = rec.count, rec.reason
    raw = min(max(raw, bounds.min_replicas), bounds.max_replicas)
    horizon = max(spec.scale_up_window_s, spec.scale_down_window_s)
    history = tuple((t, r) for t, r in st.recommendations if now - t <= horizon) + ((now, raw),)
    since = st.observed_since if st.observed_since is not None else now
    st = replace(st, recommendations=history, observed_since=since,
                 waiting=inp.metrics.requests_waiting if inp.metrics else None)

    desired = current
    hold: str | None = HOLD_STEADY
    if raw > current:
        lowest = min(r for t, r in history if now - t <= spec.scale_up_window_s)
        desired, hold = (min(lowest, current + spec.max_step), None) if lowest > current else (current, HOLD_STABILISING)
    elif raw < current:
        highest = max(r for t, r in history if now - t <= spec.scale_down_window_s)
        if now - since < spec.scale_down_window_s or highest >= current:
            hold = HOLD_STABILISING
        elif inp.rollout_in_progress:
            hold = HOLD_ROLLOUT
        else:
            desired, hold = max(highest, current - spec.max_step), None
    desired = min(max(desired, bounds.min_replicas), bounds.max_replicas)
    reason = why if hold is None else f"holding ({hold}): {why}"
    return RoleDecision(current, desired, raw, _outcome(current, desired), hold, reason), st


def _outcome(current: int, desired: int) -> Outcome:
    return "scale-up" if desired > current else "scale-down" if desired < current else "hold"


def decide(spec: AutoscalerSpec, band: RatioBand | None, inputs: Mapping[Role, RoleInput],
           state: AutoscalerState, now: float) -> Decision:
    """Both roles' desired counts for this pass, the band applied last."""
    decisions: dict[Role, RoleDecision] = {}
    states: dict[Role, RoleState] = {}
    recs: dict[Role, Recommendation | None] = {}
    fresh = {r: inputs[r].metrics if _fresh(inputs[r].metrics, spec, now) is None else None for r in ROLES}
    p = fresh["prefill"]
    queued = p is not None and p.requests_waiting > QUEUE_HIGH * p.pods_reporting
    coupling = Coupling() if p is None else Coupling(
        prefill_in_flight=p.requests_running + (0 if queued else p.requests_waiting), prefill_queued=queued)
    for role in ("decode", "prefill"):  # decode first: whether prefill's TTFT is its own depends on it
        m, current = fresh[role], inputs[role].replicas
        decode, d = recs.get("decode"), fresh["decode"]
        starting = d is not None and d.pods_reporting < inputs["decode"].replicas and decode is not None \
            and decode.signal != "down"
        short = decode is not None and (decode.count > inputs["decode"].replicas or starting)
        coupling = replace(coupling, decode_short=short, decode_growth=(
            decode.count / d.pods_reporting if short and decode is not None and d is not None else 1.0))
        recs[role] = (recommend(role, spec, m, current, coupling, state.roles[role].waiting)
                      if m is not None else None)
    for role in ROLES:
        decisions[role], states[role] = _decide_role(role, spec, inputs[role], recs[role], state.roles[role], now)
    band_reason = None
    if band is not None:
        floor = {r: inputs[r].replicas if inputs[r].rollout_in_progress else spec.bounds[r].min_replicas
                 for r in ROLES}
        result = apply_band(
            band, Counts(decisions["prefill"].desired, decisions["decode"].desired),
            max_counts=Counts(spec.bounds["prefill"].max_replicas, spec.bounds["decode"].max_replicas),
            floor=Counts(floor["prefill"], floor["decode"]))
        band_reason = result.reason
        for role, count in zip(ROLES, (result.counts.prefill, result.counts.decode)):
            rd = decisions[role]
            if count != rd.desired:
                decisions[role] = replace(rd, desired=count, outcome=_outcome(rd.current, count),
                                          reason=f"{rd.reason}; ratio band: {result.reason}")
    for role in ROLES:
        if decisions[role].acted:
            states[role] = replace(states[role], last_scale_time=now)
    return Decision(decisions, band_reason, AutoscalerState(states))
