"""The autoscaler, the P:D ratio band and `spec.scaling`, offline: pure functions, a fake clock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
import re
from typing import Any

import pytest

from disagg.operator.autoscaler import (
    HOLD_MISSING,
    HOLD_ROLLOUT,
    HOLD_STABILISING,
    HOLD_STALE,
    AutoscalerState,
    Decision,
    RoleInput,
    RoleMetrics,
    decide,
)
from disagg.operator.ratio import Counts, apply_band
from disagg.operator.scaling import (
    RatioBand,
    ScalingSpec,
    ScalingSpecError,
    parse_scaling,
    satisfiable,
    scaling_schema,
)

SPEC: dict[str, Any] = {
    "autoscaler": {
        "prefill": {"minReplicas": 1, "maxReplicas": 10},
        "decode": {"minReplicas": 1, "maxReplicas": 10},
        "targets": {"ttftP90Ms": 500, "tpotP90Ms": 50},
        "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300,
        "maxStep": 2,
        "metricsMaxAgeSeconds": 60,
    },
}


def parse(overrides: Mapping[str, Any] | None = None, ratio: Mapping[str, str] | None = None) -> ScalingSpec:
    auto = {**SPEC["autoscaler"], **(overrides or {})}
    return parse_scaling({"autoscaler": auto, **({"ratio": ratio} if ratio else {})})


def metrics(now: float, *, pods: int = 2, ttft: float | None = 0.2, tpot: float | None = 0.02, waiting: int = 0,
            running: int = 4, kv_free: int = 800, prompt_rate: float = 100.0) -> RoleMetrics:
    return RoleMetrics(scraped_at=now, pods_reporting=pods, ttft_p90_s=ttft, tpot_p90_s=tpot,
                       requests_waiting=waiting, requests_running=running, kv_blocks_free=kv_free,
                       kv_blocks_total=1000, prompt_tokens_per_s=prompt_rate, generation_tokens_per_s=50.0)


class Loop:
    """Calls `decide` every `period` seconds and applies its counts, as the operator would."""

    def __init__(self, spec: ScalingSpec, prefill: int = 2, decode: int = 2, period: float = 15) -> None:
        assert spec.autoscaler is not None
        self.spec, self.period = spec, period
        self.counts = {"prefill": prefill, "decode": decode}
        self.state, self.now, self.actions = AutoscalerState(), 1000.0, 0

    def step(self, prefill: RoleMetrics | None = None, decode: RoleMetrics | None = None,
             rollout: bool = False) -> Decision:
        self.now += self.period
        quiet = metrics(self.now, pods=self.counts["decode"])
        inputs = {"prefill": RoleInput(self.counts["prefill"], prefill or quiet, rollout),
                  "decode": RoleInput(self.counts["decode"], decode or quiet, rollout)}
        assert self.spec.autoscaler is not None
        d = decide(self.spec.autoscaler, self.spec.ratio, inputs, self.state, self.now)
        self.state = d.state
        for role, rd in d.roles.items():
            self.actions += rd.acted
            self.counts[role] = rd.desired
        return d


# --- spec.scaling ----------------------------------------------------------------


def test_parse_reads_every_field_and_ratios_as_per_mille() -> None:
    s = parse({"prefill": {"minReplicas": 2, "maxReplicas": 6, "promptTokensPerSecondPerPod": 1500.5}},
              ratio={"minPrefillPerDecode": "0.5", "maxPrefillPerDecode": "2.25"})
    assert s.ratio == RatioBand(500, 2250)
    assert s.autoscaler is not None
    assert s.autoscaler.bounds["prefill"].min_replicas == 2
    assert s.autoscaler.bounds["prefill"].capacity_per_pod == 1500.5
    assert s.autoscaler.bounds["decode"].capacity_per_pod is None
    assert (s.autoscaler.ttft_p90_target_s, s.autoscaler.tpot_p90_target_s) == (0.5, 0.05)
    assert parse_scaling(None) == ScalingSpec(None, None)


@pytest.mark.parametrize(("overrides", "ratio", "message"), [
    ({"prefill": {"minReplicas": 5, "maxReplicas": 2}}, None, "minReplicas (5) is above"),
    ({"targets": {"ttftP90Ms": 0, "tpotP90Ms": 50}}, None, "ttftP90Ms must be between 1"),
    ({"targets": {"ttftP90Ms": 500, "tpotP90Ms": -3}}, None, "tpotP90Ms must be between 1"),
    ({"scaleDownStabilizationSeconds": 7200}, None, "scaleDownStabilizationSeconds must be between 0 and 3600"),
    ({"maxStep": 0}, None, "maxStep must be between 1"),
    ({"metricsMaxAgeSeconds": 1}, None, "metricsMaxAgeSeconds must be between 5"),
    ({"maxStep": "2"}, None, "maxStep must be an integer"),
    ({"targets": None}, None, "targets is required"),
    ({}, {"minPrefillPerDecode": 0.5, "maxPrefillPerDecode": "2"}, "decimal string"),
    ({}, {"minPrefillPerDecode": "0.1234", "maxPrefillPerDecode": "2"}, "decimal string"),
    ({}, {"minPrefillPerDecode": "0", "maxPrefillPerDecode": "2"}, "above 0"),
    ({}, {"minPrefillPerDecode": "3", "maxPrefillPerDecode": "2"}, "is above maxPrefillPerDecode"),
    # 1 to 2 prefill pods can never be 3 per decode, however few the decodes.
    ({"prefill": {"minReplicas": 1, "maxReplicas": 2}}, {"minPrefillPerDecode": "3", "maxPrefillPerDecode": "4"},
     "no counts satisfy the band"),
])
def test_parse_refuses_bad_input_with_the_field_named(overrides: Mapping[str, Any], ratio: Mapping[str, Any] | None,
                                                      message: str) -> None:
    with pytest.raises(ScalingSpecError, match=re.escape(message)):
        parse(overrides, ratio)  # type: ignore[arg-type]


def test_a_band_alone_is_refused_when_no_cluster_can_meet_it() -> None:
    """Without an autoscaler the counts go up to what replicas allow, one pod of each role at least."""
    with pytest.raises(ScalingSpecError, match="no counts satisfy the band .* prefill in \\[1, 256\\]"):
        parse_scaling({"ratio": {"minPrefillPerDecode": "300", "maxPrefillPerDecode": "1000"}})
    assert parse_scaling({"ratio": {"minPrefillPerDecode": "256", "maxPrefillPerDecode": "256"}}).ratio is not None


def test_schema_matches_the_parser_defaults_and_pattern() -> None:
    schema = scaling_schema()
    auto = schema["properties"]["autoscaler"]["properties"]
    assert auto["scaleDownStabilizationSeconds"]["default"] == 300
    assert auto["targets"]["properties"]["ttftP90Ms"]["minimum"] == 1
    assert schema["properties"]["ratio"]["required"] == ["minPrefillPerDecode", "maxPrefillPerDecode"]
    pattern = schema["properties"]["ratio"]["properties"]["minPrefillPerDecode"]["pattern"]
    assert re.match(pattern, "0.125") and not re.match(pattern, "0.1255") and not re.match(pattern, "-1")


# --- the ratio band ----------------------------------------------------------------


BAND = RatioBand(500, 2000)  # 1 prefill per 2 decodes up to 2 per decode
LIMITS = Counts(10, 10)
FLOOR = Counts(1, 1)


def test_band_grows_the_short_side_and_says_why() -> None:
    r = apply_band(BAND, Counts(1, 6), max_counts=LIMITS, floor=FLOOR)
    assert r.counts == Counts(3, 6) and r.satisfied
    assert r.reason is not None and "prefill 1->3" in r.reason and "below" in r.reason
    r = apply_band(BAND, Counts(7, 2), max_counts=LIMITS, floor=FLOOR)
    assert r.counts == Counts(7, 4) and r.reason is not None and "decode 2->4" in r.reason


def test_band_leaves_counts_inside_alone_and_shrinks_only_when_growth_is_capped() -> None:
    assert apply_band(BAND, Counts(2, 3), max_counts=LIMITS, floor=FLOOR).reason is None
    # Prefill capped at 3 cannot reach 4 per 8 decodes: the decodes shrink, as little as the band needs.
    r = apply_band(BAND, Counts(2, 8), max_counts=Counts(3, 10), floor=FLOOR)
    assert r.counts == Counts(2, 4) and r.satisfied
    assert r.reason is not None and "decode 8->4" in r.reason and "maximum 3" in r.reason


def test_band_respects_a_rollout_floor_and_reports_when_it_cannot_fit() -> None:
    r = apply_band(BAND, Counts(1, 8), max_counts=Counts(1, 10), floor=Counts(1, 8))
    assert not r.satisfied and r.counts == Counts(1, 8)
    assert r.reason is not None and "kept as asked" in r.reason


def test_satisfiable_matches_a_brute_force_search() -> None:
    from disagg.operator.scaling import RoleBounds
    for lo, hi in [(500, 2000), (3000, 4000), (333, 333), (1500, 1500)]:
        band = RatioBand(lo, hi)
        for pmax in range(1, 5):
            p, d = RoleBounds(1, pmax), RoleBounds(2, 4)
            brute = any(band.contains(x, y) for x in range(1, pmax + 1) for y in range(2, 5))
            assert satisfiable(band, p, d) == brute, (lo, hi, pmax)


# --- the autoscaler ----------------------------------------------------------------


def test_prefill_scales_up_on_ttft_within_max_step_after_the_up_window() -> None:
    loop = Loop(parse())
    hot = lambda: metrics(loop.now + loop.period, ttft=2.0, waiting=10)  # noqa: E731 (4x the target)
    first = loop.step(prefill=hot())  # no older, lower recommendation in the up window yet
    assert first.roles["prefill"].outcome == "scale-up"
    assert first.roles["prefill"].desired == 4  # 2 + maxStep, though the signal asked for more
    assert "TTFT" in first.roles["prefill"].reason
    assert first.roles["decode"].outcome == "hold"


def test_a_single_spike_inside_the_up_window_does_not_scale() -> None:
    loop = Loop(parse())
    loop.step()  # a calm recommendation (2) is now inside the 30 s window
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=2.0, waiting=1))
    assert d.roles["prefill"].desired == 2 and d.roles["prefill"].hold == HOLD_STABILISING
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=2.0, waiting=1))
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=2.0, waiting=1))
    assert d.roles["prefill"].desired > 2  # the spike lasted the whole window


def test_scale_down_waits_the_full_down_window_and_steps_by_at_most_max_step() -> None:
    loop = Loop(parse(), prefill=8, decode=2)
    idle = lambda: metrics(loop.now + loop.period, pods=loop.counts["prefill"], ttft=0.05, prompt_rate=5)  # noqa: E731
    times = []
    for _ in range(60):
        d = loop.step(prefill=idle())
        if d.roles["prefill"].acted:
            times.append(loop.now)
            assert d.roles["prefill"].current - d.roles["prefill"].desired <= 2
    assert times and times[0] - 1000 >= 300  # nothing before the window was observed
    assert loop.counts["prefill"] == 1  # the minimum, eventually


def test_hysteresis_no_flapping_in_the_band_between_up_and_down() -> None:
    loop = Loop(parse(), prefill=3, decode=3)
    for i in range(100):
        # Latency wanders between 0.75 and 1.05 of the target: inside the hysteresis band.
        ttft = 0.5 * (0.75 + 0.3 * ((i * 7) % 10) / 10)
        loop.step(prefill=metrics(loop.now + loop.period, pods=3, ttft=ttft),
                  decode=metrics(loop.now + loop.period, pods=3, tpot=ttft / 10))
    assert loop.actions == 0 and loop.counts == {"prefill": 3, "decode": 3}


def test_oscillating_load_does_not_flap() -> None:
    """Load that swings every minute: scale-ups may happen, but no down-up-down cycles."""
    loop = Loop(parse(), prefill=2, decode=2)
    history = []
    for i in range(200):
        hot = (i // 4) % 2 == 0
        loop.step(prefill=metrics(loop.now + loop.period, pods=loop.counts["prefill"],
                                  ttft=0.9 if hot else 0.1, prompt_rate=100))
        history.append(loop.counts["prefill"])
    downs = sum(1 for a, b in zip(history, history[1:]) if b < a)
    assert downs == 0  # the down window (300 s) always sees a hot recommendation


def test_decode_follows_kv_pressure_and_tpot() -> None:
    loop = Loop(parse(), prefill=2, decode=2)
    d = loop.step(decode=metrics(loop.now + loop.period, kv_free=20, tpot=0.03))
    assert d.roles["decode"].outcome == "scale-up" and "KV cache 98% used" in d.roles["decode"].reason
    loop = Loop(parse(), prefill=2, decode=2)
    d = loop.step(decode=metrics(loop.now + loop.period, tpot=0.08))
    assert d.roles["decode"].desired == 4 and "TPOT 80 ms" in d.roles["decode"].reason


def test_load_floor_from_profiled_capacity() -> None:
    s = parse({"prefill": {"minReplicas": 1, "maxReplicas": 10, "promptTokensPerSecondPerPod": 1000},
               "maxStep": 8})
    loop = Loop(s)
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=0.3, prompt_rate=4000))
    assert d.roles["prefill"].desired == 5  # 4000 / (1000 * 0.8)
    assert "4000 prompt tokens/s need 5 pods" in d.roles["prefill"].reason


@pytest.mark.parametrize("how", ["missing", "no-pods", "stale"])
def test_missing_or_stale_metrics_hold_and_say_so(how: str) -> None:
    loop = Loop(parse(), prefill=2, decode=2)
    when = loop.now + loop.period
    m = {"missing": None, "no-pods": replace(metrics(when, ttft=3.0), pods_reporting=0),
         "stale": metrics(when - 61, ttft=3.0)}[how]
    inputs = {"prefill": RoleInput(2, m), "decode": RoleInput(2, metrics(when))}
    assert loop.spec.autoscaler is not None
    d = decide(loop.spec.autoscaler, None, inputs, AutoscalerState(), when)
    assert d.roles["prefill"].desired == 2 and not d.roles["prefill"].acted
    assert d.roles["prefill"].hold == (HOLD_STALE if how == "stale" else HOLD_MISSING)
    assert "holding" in d.roles["prefill"].reason and d.roles["prefill"].recommendation is None


def test_a_metrics_gap_restarts_the_down_window() -> None:
    loop = Loop(parse(), prefill=6, decode=2)
    idle = lambda: metrics(loop.now + loop.period, pods=6, ttft=0.05, prompt_rate=5)  # noqa: E731
    for _ in range(19):  # 285 s of idle metrics
        loop.step(prefill=idle())
    loop.now += loop.period
    inputs = {"prefill": RoleInput(6, None), "decode": RoleInput(2, metrics(loop.now))}
    assert loop.spec.autoscaler is not None
    loop.state = decide(loop.spec.autoscaler, None, inputs, loop.state, loop.now).state
    for _ in range(19):
        d = loop.step(prefill=idle())
        assert not d.roles["prefill"].acted


def test_a_rollout_is_never_shrunk_but_may_grow() -> None:
    loop = Loop(parse(), prefill=6, decode=2)
    idle = lambda: metrics(loop.now + loop.period, pods=6, ttft=0.05, prompt_rate=5)  # noqa: E731
    for _ in range(30):
        d = loop.step(prefill=idle(), rollout=True)
    assert loop.counts["prefill"] == 6 and d.roles["prefill"].hold == HOLD_ROLLOUT
    for _ in range(3):  # the low recommendations leave the 30 s up window
        d = loop.step(prefill=metrics(loop.now + loop.period, pods=6, ttft=3.0, waiting=1), rollout=True)
    assert d.roles["prefill"].outcome == "scale-up"


def test_band_applies_after_the_recommendations_with_its_reason() -> None:
    s = parse({"scaleUpStabilizationSeconds": 0}, ratio={"minPrefillPerDecode": "0.5", "maxPrefillPerDecode": "1"})
    loop = Loop(s, prefill=2, decode=2)
    d = loop.step(decode=metrics(loop.now + loop.period, tpot=0.2))  # decode 2 -> 4 on TPOT
    assert d.roles["decode"].desired == 4 and d.roles["prefill"].desired == 2
    assert d.band_reason is None  # 2:4 is the band's edge, inside
    d = loop.step(decode=metrics(loop.now + loop.period, pods=4, tpot=0.2))  # decode 4 -> 6
    assert d.roles["decode"].desired == 6 and d.roles["prefill"].desired == 3
    assert "ratio band: prefill 2->3" in d.roles["prefill"].reason
    assert d.band_reason is not None and "below the band's 0.5" in d.band_reason


def test_bad_metrics_are_refused() -> None:
    with pytest.raises(ValueError, match="free KV blocks"):
        replace(metrics(0), kv_blocks_free=2000)
    with pytest.raises(ValueError, match="negative"):
        replace(metrics(0), requests_waiting=-1)


def test_pods_still_starting_absorb_the_latency_signal() -> None:
    """While asked-for pods start, the same breach does not ask again (no overshoot from start-up delay)."""
    loop = Loop(parse({"scaleUpStabilizationSeconds": 0}), prefill=2, decode=2)
    d = loop.step(prefill=metrics(loop.now + loop.period, pods=2, ttft=0.8, waiting=1))  # 1.6x the target
    assert d.roles["prefill"].desired == 4
    for _ in range(3):  # the two new pods start; the two old ones still see 1.6x
        d = loop.step(prefill=metrics(loop.now + loop.period, pods=2, ttft=0.8, waiting=1))
        assert d.roles["prefill"].desired == 4 and not d.roles["prefill"].acted
    d = loop.step(prefill=metrics(loop.now + loop.period, pods=4, ttft=0.8, waiting=1))  # all serve, still over
    assert d.roles["prefill"].desired == 6


def test_ttft_that_waits_on_decode_scales_decode_not_prefill() -> None:
    loop = Loop(parse({"scaleUpStabilizationSeconds": 0}), prefill=2, decode=2)
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=1.5), decode=metrics(loop.now + loop.period, kv_free=10))
    assert d.roles["decode"].outcome == "scale-up"
    assert d.roles["prefill"].outcome == "hold" and "waits on decode" in d.roles["prefill"].reason


def test_a_prefill_backlog_scales_prefill_not_decode() -> None:
    """The prefill's own queue is long: the decode's full KV is held by that queue's reservations
    (AddNewRequests reserves before the prompt queues), so prefill scales and decode holds."""
    loop = Loop(parse({"scaleUpStabilizationSeconds": 0}), prefill=2, decode=2)
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=1.5, waiting=10),
                  decode=metrics(loop.now + loop.period, kv_free=10, waiting=60))
    assert d.roles["prefill"].desired == 4  # 5 waiting per pod: doubled (the most one decision gives)
    assert d.roles["decode"].outcome == "hold"


def test_requests_retrying_add_new_requests_count_as_decode_load() -> None:
    """A full decode cannot see the requests its AddNewRequests refused; the prefills hold them.
    They are a backlog the serving pods drain too, so one pass plans for at most twice its own."""
    loop = Loop(parse({"scaleUpStabilizationSeconds": 0,
                       "decode": {"minReplicas": 1, "maxReplicas": 10, "sequencesPerPod": 10}}), prefill=2, decode=2)
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=1.5, running=60),
                  decode=metrics(loop.now + loop.period, running=20))
    assert d.roles["decode"].recommendation == 5 and "40 sequences" in d.roles["decode"].reason
    assert d.roles["decode"].desired == 4  # max step 2
    assert d.roles["prefill"].outcome == "hold" and "waits on decode" in d.roles["prefill"].reason


def test_a_profiled_capacity_lets_load_decide_the_scale_down() -> None:
    """TPOT does not fall in proportion to load (a batch of one still takes a step), so with a
    profiled capacity the load floor, with its margin, decides how far down; TPOT must be in target."""
    s = parse({"scaleDownStabilizationSeconds": 60, "maxStep": 8,
               "decode": {"minReplicas": 1, "maxReplicas": 10, "sequencesPerPod": 10}})
    loop = Loop(s, prefill=2, decode=8)
    for _ in range(6):  # 30 sequences at 0.8 of the TPOT target: 30 / (10 * 0.8 * 0.9) -> 5 pods
        d = loop.step(decode=metrics(loop.now + loop.period, pods=loop.counts["decode"], tpot=0.04, running=30))
    assert loop.counts["decode"] == 5 and d.roles["decode"].outcome == "hold"
    d = loop.step(decode=metrics(loop.now + loop.period, pods=5, tpot=0.052, running=30))  # over target: no lower
    assert d.roles["decode"].desired == 5 and d.roles["decode"].hold == "steady"


def test_a_draining_backlog_asks_for_no_more_prefill() -> None:
    """Once the pods that serve outpace arrivals, the window's p90 TTFT is the backlog's tail."""
    loop = Loop(parse({"scaleUpStabilizationSeconds": 0, "maxStep": 8}), prefill=4, decode=2)
    d = loop.step(prefill=metrics(loop.now + loop.period, pods=4, ttft=20.0, waiting=400))
    assert d.roles["prefill"].desired == 8
    loop.counts["prefill"] = 4  # as if those pods were still starting: the backlog's trend decides
    d = loop.step(prefill=metrics(loop.now + loop.period, pods=4, ttft=30.0, waiting=150))
    assert d.roles["prefill"].outcome == "hold" and "a backlog drains (400 -> 150 waiting)" in d.roles["prefill"].reason
    d = loop.step(prefill=metrics(loop.now + loop.period, pods=4, ttft=30.0, waiting=140))  # stalled: over again
    assert d.roles["prefill"].desired == 8


def test_a_prefill_ttft_tail_with_nothing_queued_asks_for_no_prefill() -> None:
    """More prefill pods shorten only the wait for one: with no request waiting, the window's high
    p90 TTFT is a backlog already served (or the wait for a decode slot)."""
    loop = Loop(parse({"scaleUpStabilizationSeconds": 0}), prefill=2, decode=2)
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=5.0, waiting=0))
    assert d.roles["prefill"].outcome == "hold" and "no request waits for a prefill" in d.roles["prefill"].reason
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=5.0, waiting=1))
    assert d.roles["prefill"].outcome == "scale-up" and "TTFT" in d.roles["prefill"].reason


def test_while_decode_pods_start_the_prefill_ttft_waits_on_them() -> None:
    """Decode pods asked for earlier are still starting (fewer report than the count): a prefill's
    TTFT includes the wait for their slots, so it does not scale prefill."""
    loop = Loop(parse({"scaleUpStabilizationSeconds": 0}), prefill=2, decode=4)
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=1.5, waiting=1),
                  decode=metrics(loop.now + loop.period, pods=2, tpot=0.06))
    assert d.roles["prefill"].outcome == "hold" and "waits on decode" in d.roles["prefill"].reason
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=1.5, waiting=1),
                  decode=metrics(loop.now + loop.period, pods=4, tpot=0.04))  # they serve: TTFT is prefill's own
    assert d.roles["prefill"].outcome == "scale-up"


def test_prefill_plans_for_the_prompt_load_a_growing_decode_lets_through() -> None:
    """A prefill admits a prompt once a decode slot is reserved: while decode is short its prompt
    rate is what decode lets through, and it grows with decode's count."""
    s = parse({"scaleUpStabilizationSeconds": 0, "maxStep": 8,
               "prefill": {"minReplicas": 1, "maxReplicas": 10, "promptTokensPerSecondPerPod": 1000},
               "decode": {"minReplicas": 1, "maxReplicas": 10, "sequencesPerPod": 10}})
    loop = Loop(s, prefill=2, decode=2)
    calm = loop.step(prefill=metrics(loop.now + loop.period, ttft=0.1, prompt_rate=1500, running=16),
                     decode=metrics(loop.now + loop.period, running=16))
    assert calm.roles["prefill"].outcome == "hold"  # 1500 tokens/s fit on 2 pods at 0.8
    d = loop.step(prefill=metrics(loop.now + loop.period, ttft=0.1, prompt_rate=1500, running=32),
                  decode=metrics(loop.now + loop.period, running=32))  # decode asks for 4 pods: twice
    assert d.roles["decode"].desired == 4
    assert d.roles["prefill"].desired == 4 and "3000 prompt tokens/s" in d.roles["prefill"].reason
