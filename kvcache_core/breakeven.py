"""Break-even table and gate (R9, docs/requirements.md): a hit is loaded only where
loading beats recomputing.

Table file (JSON, versioned)::

    {"version": 1, "gpu": "NVIDIA H200", "model": "llama-3.2-3b", "dtype": "bfloat16",
     "block_size": 256, "bandwidths": {"disk_read_gbps": 1.88, "pcie_h2d_gbps": 55.5},
     "tiers": {"dram": {"min_prefix_tokens": 2900}, "disk": {"min_prefix_tokens": null}},
     "measurements": [...], "source": "..."}

``min_prefix_tokens``: the smallest reusable prefix worth loading from that tier; ``null``
means the tier never beats recompute on this node and model (always refuse). The gate
does no measuring or fitting while serving: one comparison per lookup.

:func:`fit_from_longdoc` fits a table from a long-document run (``scripts/bench_longdoc.py``
JSON): per tier, the hit TTFT g(D) against the recompute TTFT f(D) over document sizes D
at prefix ratio 1; the threshold is where g - f changes sign for the last time (linear
interpolation between the two measured sizes around it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError

TABLE_VERSION = 1
TIERS = ("dram", "disk")


@dataclass
class BreakevenTable:
    gpu: str
    model: str
    thresholds: dict[str, int | None]
    dtype: str = ""
    block_size: int = 0
    bandwidths: dict[str, float] = field(default_factory=dict)
    measurements: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"version": TABLE_VERSION, "gpu": self.gpu, "model": self.model,
                "dtype": self.dtype, "block_size": self.block_size,
                "bandwidths": self.bandwidths,
                "tiers": {t: {"min_prefix_tokens": v} for t, v in self.thresholds.items()},
                "measurements": self.measurements, "source": self.source}


def load_table(path: str) -> BreakevenTable:
    """Read and validate a table; :class:`ConfigError` names what is wrong."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ConfigError(f"py-kvcache config key 'breakeven_table': cannot read {path}: "
                          f"{e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"py-kvcache config key 'breakeven_table': {path} is not JSON: "
                          f"{e}") from e
    if not isinstance(d, dict) or d.get("version") != TABLE_VERSION:
        raise ConfigError(f"py-kvcache config key 'breakeven_table': {path} is not a "
                          f"version-{TABLE_VERSION} break-even table")
    tiers = d.get("tiers")
    if not isinstance(tiers, dict) or not set(tiers) <= set(TIERS):
        raise ConfigError(f"py-kvcache config key 'breakeven_table': {path}: 'tiers' must map "
                          f"{' / '.join(TIERS)} to {{'min_prefix_tokens': int or null}}")
    th: dict[str, int | None] = {}
    for t, v in tiers.items():
        m = v.get("min_prefix_tokens") if isinstance(v, dict) else "?"
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
            raise ConfigError(f"py-kvcache config key 'breakeven_table': {path}: tier {t}: "
                              f"min_prefix_tokens must be a non-negative integer or null")
        th[t] = m
    return BreakevenTable(gpu=str(d.get("gpu", "")), model=str(d.get("model", "")),
                          thresholds=th, dtype=str(d.get("dtype", "")),
                          block_size=int(d.get("block_size") or 0),
                          bandwidths=dict(d.get("bandwidths") or {}),
                          measurements=list(d.get("measurements") or []),
                          source=str(d.get("source", "")))


#: Source tiers the gate sees: ``staged`` = disk blocks a preload already read into every
#: worker's staging (queue-aware preload); they cost a host->device copy, like DRAM ones,
#: so they use the DRAM tier's threshold but are counted apart.
GATE_TIERS = (*TIERS, "staged")
_THRESHOLD_OF = {"dram": "dram", "disk": "disk", "staged": "dram"}


class Gate:
    """Accept or refuse a reusable prefix by its source tier (scheduler thread only)."""

    def __init__(self, table: BreakevenTable) -> None:
        self.table = table
        # a tier missing from the table is not gated (min 0)
        self._min = {t: table.thresholds.get(_THRESHOLD_OF[t], 0) for t in GATE_TIERS}
        self.counters = {f"gate_{a}_{t}": 0 for a in ("accepted", "refused")
                         for t in GATE_TIERS}

    def never(self, tier: str) -> bool:
        """True if the table refuses every prefix from ``tier`` (threshold null)."""
        return self._min[tier] is None

    def passes(self, tier: str, prefix_tokens: int) -> bool:
        """Whether a prefix of ``prefix_tokens`` from ``tier`` is worth loading (not
        counted)."""
        m = self._min[tier]
        return m is not None and prefix_tokens >= m

    def count(self, tier: str, accepted: bool) -> None:
        """Count one decision (the connector counts a request once, when it is
        scheduled, not at every lookup of a request that keeps waiting)."""
        self.counters[f"gate_{'accepted' if accepted else 'refused'}_{tier}"] += 1

    def allows(self, tier: str, prefix_tokens: int) -> bool:
        """:meth:`passes`, counted as accepted / refused for ``tier``."""
        ok = self.passes(tier, prefix_tokens)
        self.count(tier, ok)
        return ok


class QueueModel:
    """Expected queueing time against preload read time (queue-aware preload, R9 item 4).

    ``recompute_s(tokens)``: the table's measured recompute TTFT, linear between the
    measured sizes and proportional beyond them (per-token cost of the nearest end).
    ``read_s(nbytes)``: bytes over the table's disk read bandwidth. ``worth(ahead_s,
    queued_bytes)``: a request whose predecessors in the queue take ``ahead_s`` to compute
    gets its blocks staged in time if the reads queued before and for it
    (``queued_bytes``, read one at a time) finish first. Pure arithmetic; scheduler thread.
    """

    def __init__(self, table: BreakevenTable) -> None:
        pts: dict[int, float] = {}
        for m in table.measurements:
            t, r = m.get("tokens"), m.get("recompute_s")
            if isinstance(t, int) and t > 0 and isinstance(r, (int, float)) and r > 0:
                pts[t] = r
        if not pts:
            raise ValueError("the break-even table has no recompute measurements")
        self._pts = sorted(pts.items())
        bw = (table.bandwidths or {}).get("disk_read_gbps")
        if not isinstance(bw, (int, float)) or bw <= 0:
            raise ValueError("the break-even table has no disk_read_gbps bandwidth")
        self._bps = float(bw) * 1e9

    def recompute_s(self, tokens: int) -> float:
        pts = self._pts
        if tokens <= pts[0][0]:
            return pts[0][1] * tokens / pts[0][0]
        for (d0, y0), (d1, y1) in zip(pts, pts[1:], strict=False):
            if tokens <= d1:
                return y0 + (y1 - y0) * (tokens - d0) / (d1 - d0)
        d, y = pts[-1]
        return y * tokens / d

    def read_s(self, nbytes: int) -> float:
        return nbytes / self._bps

    def worth(self, ahead_s: float, queued_bytes: int) -> bool:
        return ahead_s >= self.read_s(queued_bytes)


def _crossing(points: list[tuple[int, float]]) -> int | None:
    """Smallest size from which the load wins at every larger measured size.

    ``points``: (tokens, hit - recompute) sorted by tokens. Interpolates linearly between
    the last losing and the first winning size of the final winning run.
    """
    if not points or points[-1][1] >= 0:
        return None  # loses (or ties) at the largest size: never worth it
    i = len(points) - 1
    while i > 0 and points[i - 1][1] < 0:
        i -= 1
    if i == 0:
        return 0  # wins everywhere measured
    (d0, y0), (d1, y1) = points[i - 1], points[i]
    return int(math.ceil(d0 + (d1 - d0) * (y0 / (y0 - y1))))


def fit_from_longdoc(run: dict[str, Any]) -> BreakevenTable:
    """Fit a table from a ``bench_longdoc.py`` result (prefix ratio 1)."""
    rows = [r for r in run.get("results", []) if "ttft_hit_s" in r]
    rec = {r["tokens"]: r["ttft_cold_s"] for r in rows if r["config"] == "recompute"}
    if not rec:
        raise ValueError("the run has no 'recompute' rows")
    src = {"dram": "kvcache_dram", "disk": "kvcache_disk"}
    th: dict[str, int | None] = {}
    meas = []
    for tier, cfg in src.items():
        pts = []
        for r in rows:
            if r["config"] != cfg or r["tokens"] not in rec:
                continue
            hit = r.get("ttft_first_hit_s") if tier == "disk" else None
            hit = hit if hit is not None else r["ttft_hit_s"]
            pts.append((r["tokens"], hit - rec[r["tokens"]]))
            meas.append({"tier": tier, "tokens": r["tokens"], "hit_s": hit,
                         "recompute_s": rec[r["tokens"]]})
        if pts:
            th[tier] = _crossing(sorted(pts))
    # runs older than the block_size / dtype fields used 256-token bf16 blocks
    return BreakevenTable(gpu=str(run.get("gpu") or run.get("machine", "")),
                          model=str(run.get("model", "")), thresholds=th,
                          dtype=str(run.get("dtype") or "bfloat16"),
                          block_size=int(run.get("block_size") or 256),
                          bandwidths={"disk_read_gbps": run.get("disk_read_gbps"),
                                      "pcie_h2d_gbps": run.get("pcie_h2d_gbps")},
                          measurements=meas, source="bench_longdoc (prefix ratio 1)")
