#!/usr/bin/env python3
"""``kvcache bench storage`` on a real GlusterFS volume (issue 16 item 5).

Brings up one glusterd on 127.0.0.1 and one volume of ``--layout`` (the test fixture's
``tests/helpers/gluster.py``: root, Debian's glusterfs packages), mounts it through FUSE,
runs the storage benchmark with its root on the mount, and tears everything down (also
on an error or Ctrl-C). The result sits beside the local-disk run in docs/results/cpu/:

    python3 scripts/bench_glusterfs.py --json docs/results/cpu/storage-glusterfs.json

On loopback the FUSE client and the brick share the machine's cores with the benchmark,
so the figures are a floor for a real cluster, not a prediction of one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from helpers.gluster import LAYOUTS, GlusterSession, GlusterUnavailable  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="single", choices=LAYOUTS,
                    help="volume layout: one brick, replica 2 or two-brick distribute")
    ap.add_argument("--json", required=True, help="result file (+ .md and .png)")
    ap.add_argument("--full", action="store_true",
                    help="the full benchmark (default: --quick, metadata up to 100k files)")
    args = ap.parse_args(argv)
    gs = GlusterSession()
    try:
        try:
            gs.start()
        except GlusterUnavailable as e:
            print(f"bench_glusterfs: GlusterFS unavailable: {e}", file=sys.stderr)
            return 2
        m1, _m2 = gs.volume(args.layout)
        print(f"bench_glusterfs: {args.layout} volume mounted on {m1}", file=sys.stderr,
              flush=True)
        cmd = [sys.executable, "-m", "kvcache_core.cli", "bench", "storage", "--root", m1,
               "--json", os.path.abspath(args.json)]
        if not args.full:
            cmd.append("--quick")
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode
    finally:
        problems = gs.close()
        if problems:
            print(f"bench_glusterfs: teardown: {problems}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
