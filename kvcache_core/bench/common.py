"""Small helpers shared by the benchmark programs (no heavy imports at module level)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def run_cases(script: str, cases: Sequence[str], child_args: Sequence[str],
              tag: str) -> dict[str, Any]:
    """Run ``script --child CASE *child_args`` once per case, each in its own process
    (process-wide settings such as the switch interval stay apart), with progress on
    stderr; the child prints its result as JSON on its last stdout line."""
    out: dict[str, Any] = {}
    for i, name in enumerate(cases, 1):
        print(f"[{tag}] [{i}/{len(cases)}] {name}", file=sys.stderr, flush=True)
        res = subprocess.run([sys.executable, script, "--child", name, *child_args],
                             capture_output=True, text=True, check=True)
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def write_json_md(path: str, data: dict[str, Any], lines: list[str]) -> None:
    """Write ``data`` to ``path`` (JSON) and ``lines`` to the ``.md`` next to it; print
    the table."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def save_loglog(fig: Any, ax: Any, ylabel: str, title: str, path: str) -> None:
    """Finish a plot over document tokens (log2 x, log y, grid, legend) and save it."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("document tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_stats_file(path: str, since: float | None = None, timeout: float = 2.0
                    ) -> dict[str, Any]:
    """The scheduler's counters from ``$KVCACHE_STATS_FILE`` (``{}`` when absent or
    unreadable). The file is written by a background thread shortly after each engine
    step (``kvcache_core.vllm.manager``); with ``since`` (``time.time()`` taken after
    the step whose counters are wanted) this waits up to ``timeout`` seconds for a
    write at or after it."""
    import time

    end = time.monotonic() + timeout
    while True:
        try:
            fresh = since is None or os.stat(path).st_mtime >= since
            if fresh or time.monotonic() >= end:
                with open(path) as f:
                    return json.load(f)
        except (OSError, ValueError):
            if time.monotonic() >= end:
                return {}
        time.sleep(0.01)
