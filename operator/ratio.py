"""The P:D ratio band, applied after the per-role recommendations, whoever made them.

Pure. Given the two counts that the autoscaler, an HPA or a person asked for,
`apply_band` returns the nearest counts inside the band and the reason for any
change. It prefers growing the side that is short over shrinking the other:
a recommendation to grow came from a real load signal, and shrinking the side
that asked for pods would undo it. It shrinks only where growing is capped by
`max_replicas`, and never shrinks a role below `floor` (its current count
during a rollout, which is never shrunk mid-way).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.operator.scaling import RatioBand


@dataclass(frozen=True)
class Counts:
    prefill: int
    decode: int


@dataclass(frozen=True)
class BandResult:
    counts: Counts
    reason: str | None  # None when the asked counts were already in the band
    satisfied: bool  # False when no count within the limits fits: the asked counts are kept


def apply_band(band: RatioBand, asked: Counts, *, max_counts: Counts, floor: Counts) -> BandResult:
    """The counts in `band` nearest to `asked`, growing the short side first.

    `max_counts` caps growth (the roles' maxReplicas); `floor` bounds shrinking
    (minReplicas, or the current count during a rollout). Counts are at most a
    few hundred, so a scan is exact and cheap.
    """
    p, d = asked.prefill, asked.decode
    if band.contains(p, d):
        return BandResult(asked, None, True)
    lo, hi = band.min_per_mille / 1000, band.max_per_mille / 1000
    below = 1000 * p < band.min_per_mille * d  # too few prefill pods for the decodes
    where = f"P:D {p}:{d} is {'below' if below else 'above'} the band's {lo if below else hi:g}"
    # 1. Grow the short side: prefill when below, decode when above.
    if below:
        grown = next((x for x in range(p + 1, max_counts.prefill + 1) if band.contains(x, d)), None)
        if grown is not None:
            return BandResult(Counts(grown, d), f"prefill {p}->{grown}: {where}", True)
    else:
        grown = next((x for x in range(d + 1, max_counts.decode + 1) if band.contains(p, x)), None)
        if grown is not None:
            return BandResult(Counts(p, grown), f"decode {d}->{grown}: {where}", True)
    # 2. Shrink the long side, as little as possible.
    if below:
        shrunk = next((x for x in range(d - 1, floor.decode - 1, -1) if x > 0 and band.contains(p, x)), None)
        if shrunk is not None:
            return BandResult(Counts(p, shrunk), f"decode {d}->{shrunk}: {where} and prefill is at its "
                                                 f"maximum {max_counts.prefill}", True)
    else:
        shrunk = next((x for x in range(p - 1, floor.prefill - 1, -1) if x > 0 and band.contains(x, d)), None)
        if shrunk is not None:
            return BandResult(Counts(shrunk, d), f"prefill {p}->{shrunk}: {where} and decode is at its "
                                                 f"maximum {max_counts.decode}", True)
    # 3. Move both: the nearest pair within the limits (a narrow band can need it).
    pairs = [(abs(x - p) + abs(y - d), -(x + y), x, y)
             for x in range(max(floor.prefill, 1), max_counts.prefill + 1)
             for y in range(max(floor.decode, 1), max_counts.decode + 1) if band.contains(x, y)]
    if pairs:
        _, _, x, y = min(pairs)
        return BandResult(Counts(x, y), f"prefill {p}->{x}, decode {d}->{y}: {where}", True)
    return BandResult(asked, f"{where}, and no counts within the roles' limits fit [{lo:g}, {hi:g}]; "
                             "kept as asked", False)
