#!/usr/bin/env python3
"""Write the Grafana dashboard for py-kvcache (docs/grafana/py-kvcache.json).

Every py-kvcache series it queries is one that vLLM's /metrics exposes for the connector
(``PyKVCacheSpec.build_metric_definitions``: counters get Prometheus' ``_total``);
``tests/test_dashboard.py`` checks that and that the committed file is this script's
output. Import it in Grafana (Dashboards > New > Import) and pick the Prometheus data
source that scrapes vLLM's /metrics.

    python3 scripts/make_dashboard.py [--out docs/grafana/py-kvcache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

P = "vllm:pykvcache_"
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "grafana", "py-kvcache.json")


def _rate(name: str, legend: str) -> dict:
    return {"expr": f"sum(rate({P}{name}_total[$__rate_interval]))", "legendFormat": legend}


def _quantile(q: float, name: str, legend: str) -> dict:
    return {"expr": f"histogram_quantile({q}, sum by (le) (rate({P}{name}_seconds_bucket"
                    "[$__rate_interval])))", "legendFormat": legend}


def _gauge(name: str, legend: str) -> dict:
    return {"expr": f"sum({P}{name})", "legendFormat": legend}


#: (title, unit, kind, targets); kind "stat" or "timeseries"
PANELS: list[tuple[str, str, str, list[dict]]] = [
    ("Healthy (1 = serving, 0 = recompute-only)", "none", "stat",
     [{"expr": f"min({P}healthy)", "legendFormat": "healthy"}]),
    ("Lookups by outcome (chunks/s)", "ops", "timeseries",
     [_rate("hits_dram", "DRAM hit"), _rate("hits_staged", "staged (preload) hit"),
      _rate("hits_disk", "disk hit"), _rate("hits_pending", "hit pending (read in flight)"),
      _rate("misses", "miss"), _rate("loads_joined", "load joined a read in flight")]),
    ("Job latency p50 / p99 (store: until acknowledged; load: until on the device)", "s",
     "timeseries",
     [_quantile(q, h, f"{h} p{int(q * 100)}") for h in ("store", "load_dram", "load_disk")
      for q in (0.5, 0.99)]),
    ("Disk traffic", "Bps", "timeseries",
     [_rate("bytes_read", "read"), _rate("bytes_written", "written")]),
    ("Stores and drops by cause (chunks/s)", "ops", "timeseries",
     [_rate("stores", "stored"), _rate("stores_written", "file written"),
      _rate("stores_dropped_backpressure", "dropped: back-pressure"),
      _rate("stores_dropped_capacity", "dropped: max_disk_bytes"),
      _rate("stores_dropped_enospc", "dropped: disk full"),
      _rate("stores_no_dram_slot", "no DRAM slot"),
      _rate("stores_writeback_full", "DRAM only: write-back share full"),
      _rate("stores_skipped_gate", "skipped: gate (no files)")]),
    ("Break-even gate (requests/s)", "ops", "timeseries",
     [_rate(f"gate_{a}_{t}", f"{a} {t}") for a in ("accepted", "refused")
      for t in ("dram", "staged", "disk")]),
    ("Preload (chunks/s)", "ops", "timeseries",
     [_rate("preloads_planned", "planned"), _rate("preloads_staged", "staged"),
      _rate("preloads_claimed", "claimed"), _rate("preloads_requeued", "requeued"),
      _rate("preloads_wasted", "wasted (reclaimed unclaimed)")]),
    ("DRAM tier occupancy (slots)", "none", "timeseries",
     [_gauge("dram_slots", "slots"), _gauge("dram_cached", "holding a block"),
      _gauge("dram_writeback_pinned", "pinned until written"),
      _gauge("dram_unwritten", "no file (write-back was full)")]),
    ("Disk tier occupancy", "bytes", "timeseries",
     [_gauge("disk_bytes", "published bytes (shared ledger)")]),
    ("Jobs in flight (chunks)", "none", "timeseries",
     [_gauge("stores_in_flight", "stores"), _gauge("loads_in_flight", "loads")]),
    ("Failures (per s)", "ops", "timeseries",
     [_rate("load_failures", "load failed (recomputed)"),
      _rate("files_corrupt", "corrupt file"), _rate("files_missing", "file gone"),
      _rate("load_errors", "I/O error"), _rate("ops_expired", "I/O deadline expired"),
      _rate("reactor_dead", "reactor died")]),
    ("vLLM: time to first token (p50 / p90)", "s", "timeseries",
     [{"expr": "histogram_quantile(0.5, sum by (le) (rate("
               "vllm:time_to_first_token_seconds_bucket[$__rate_interval])))",
       "legendFormat": "p50"},
      {"expr": "histogram_quantile(0.9, sum by (le) (rate("
               "vllm:time_to_first_token_seconds_bucket[$__rate_interval])))",
       "legendFormat": "p90"}]),
    ("vLLM: GPU prefix cache hit rate", "percentunit", "timeseries",
     [{"expr": "sum(rate(vllm:prefix_cache_hits_total[$__rate_interval])) / "
               "sum(rate(vllm:prefix_cache_queries_total[$__rate_interval]))",
       "legendFormat": "GPU prefix cache"}]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, kind, targets) in enumerate(PANELS):
        w = 6 if kind == "stat" else 12
        panels.append({
            "id": i + 1, "type": kind, "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": w, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{**t, "refId": chr(65 + j),
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, t in enumerate(targets)],
        })
    return {
        "title": "py-kvcache (vLLM external KV cache)", "uid": "py-kvcache",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "tags": ["vllm", "py-kvcache"],
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="where to write the dashboard JSON")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(render())
    print(f"wrote {a.out} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
