"""`kvcache` command line: benchmarks, inspection and maintenance of a cache root.

Follows vLLM's conventions: JSON config (``--config FILE`` or inline JSON), ``--help``
on every subcommand explaining every key, ``--json FILE`` wherever something is measured.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import stat
import sys

from .config import KEY_HELP, ConfigError, StorageConfig

log = logging.getLogger("kvcache_core.cli")


def _config_epilog() -> str:
    lines = ["configuration keys (JSON object, also valid in vLLM's kv_connector_extra_config):"]
    defaults = StorageConfig()
    for k in StorageConfig.keys():
        v = getattr(defaults, k)
        shown = f"0o{v:o}" if k.endswith("_mode") else repr(v)
        lines.append(f"  {k} (default {shown}):\n      {KEY_HELP[k]}")
    try:  # the vLLM glue's keys (no vLLM import needed)
        from .vllm.options import GLUE_KEY_HELP
    except Exception:  # pragma: no cover
        GLUE_KEY_HELP = {}
    lines.append("vLLM glue keys (kv_connector_extra_config only):")
    for k, h in GLUE_KEY_HELP.items():
        lines.append(f"  {k}:\n      {h}")
    return "\n".join(lines)


def _cmd_bench_storage(args: argparse.Namespace) -> int:
    from .bench import storage

    out = storage.run(args)
    keys = ("engine", "raw_read_gbps", "reactor_read_gbps", "raw_write_gbps",
            "reactor_write_gbps", "pool_bytes", "peak_staging_bytes", "lookup_per_s",
            "publish_per_s", "files_in_root")
    print(json.dumps({k: out.get(k) for k in keys}, indent=1))
    return 0


def _iter_namespaces(root: str):
    """Yield (directory name, meta.json contents) of every namespace under ``root``.

    Never follows a symbolic link: a linked namespace directory or ``meta.json`` is
    skipped with a warning; so is a ``meta.json`` that is not a regular file."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for ent in entries:
        if ent.is_symlink():
            log.warning("kvcache: %s is a symbolic link; skipped (never followed)", ent.path)
            continue
        if not ent.is_dir(follow_symlinks=False):
            continue
        meta = os.path.join(ent.path, "meta.json")
        try:  # O_NONBLOCK: a FIFO planted there must not block the walk
            fd = os.open(meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            log.warning("kvcache: %s is a symbolic link; namespace skipped (never followed)",
                        meta)
            continue
        with open(fd) as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("kvcache: %s is not a regular file; namespace skipped", meta)
                continue
            data = json.load(f)
        yield ent.name, data


def _open_layout(root: str, name: str, meta: dict, allow_foreign_root: bool = False):
    from .layout import Layout, Namespace

    ns = Namespace(**{k: v for k, v in meta.items() if k != "format_version"})
    lay = Layout(root, ns, allow_foreign_root=allow_foreign_root)
    if lay.base != os.path.join(os.path.abspath(root), name):
        raise ConfigError(f"namespace directory {name} does not match its meta.json")
    return lay


def _cmd_inspect(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.root):
        print(f"kvcache inspect: {args.root} is not a directory", file=sys.stderr)
        return 2
    report = []
    for name, meta in _iter_namespaces(args.root):
        lay = _open_layout(args.root, name, meta, args.allow_foreign_root)
        files, nbytes = lay.scan()
        report.append({"namespace": name, **meta, "files": files, "bytes": nbytes,
                       "ledger_bytes": lay.ledger.get(),
                       "symlinks_skipped": lay.stats.symlinks_skipped})
        lay.close()
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    total = 0
    for name, meta in _iter_namespaces(args.root):
        # collects dead writers' temp files; never follows a symbolic link
        lay = _open_layout(args.root, name, meta, args.allow_foreign_root)
        total += lay.stats.temp_collected + lay.collect_stale_temps(args.max_age)
        files, nbytes = lay.scan()
        lay.ledger.set(nbytes)
        links = (f"; {lay.stats.symlinks_skipped} symbolic links skipped"
                 if lay.stats.symlinks_skipped else "")
        print(f"{name}: {files} files, {nbytes} bytes; ledger resynced{links}")
        lay.close()
    print(f"removed {total} temp files")
    return 0


def _cmd_patch_vllm(args: argparse.Namespace) -> int:
    from . import patching

    try:
        if args.check:
            states = patching.check_series(args.target, args.vllm_version)
        elif args.reverse:
            states = patching.reverse_series(args.target, args.vllm_version)
        else:
            states = patching.apply_series(args.target, args.vllm_version)
    except patching.PatchError as e:
        print(f"kvcache patch-vllm: {e}", file=sys.stderr)
        return 2
    for s in states:
        print(f"{s.name}: {s.state}")
    if args.check:
        return 0 if all(s.state == "applied" for s in states) else 1
    return 0


def _boundary_sizes(th: int | None, measured: set[int], top: int) -> list[int]:
    """Extra document sizes just below and above a threshold (multiples of 256 tokens,
    within the measured range, not already measured)."""
    if not th:
        return []
    out = []
    for f in (0.8, 1.25):
        d = max(256, int(round(th * f / 256)) * 256)
        if d <= top and d not in measured:
            out.append(d)
    return out


def _calibrate_measure(args: argparse.Namespace) -> dict:
    """Run the long-document measurements for calibration (resumable: every finished
    configuration is saved in ``<out>.run.json`` and skipped when run again)."""
    from .bench import longdoc
    from .breakeven import fit_from_longdoc

    run_path = os.path.splitext(args.out)[0] + ".run.json"
    base = ["--model", args.model, "--root", args.root, "--docs", str(args.docs),
            "--repeats", str(args.repeats), "--configs", "recompute,kvcache_dram,kvcache_disk"]
    print(f"kvcache calibrate: step 1/2, sizes {args.tokens} -> {run_path}", file=sys.stderr)
    rc = longdoc.main([*base, "--tokens", args.tokens, "--json", run_path, "--append",
                       "--resume"])
    if rc:
        raise SystemExit(rc)
    with open(run_path) as f:
        run = json.load(f)
    if args.no_check:
        return run
    table = fit_from_longdoc(run)
    measured = {r["tokens"] for r in run["results"] if "tokens" in r}
    extra = sorted({d for t in table.thresholds.values()
                    for d in _boundary_sizes(t, measured, max(measured))})
    check_path = os.path.splitext(args.out)[0] + ".check.json"
    if extra:
        print(f"kvcache calibrate: step 2/2, boundary check at {extra} tokens -> {check_path}",
              file=sys.stderr)
        rc = longdoc.main([*base, "--tokens", ",".join(map(str, extra)), "--json", check_path,
                           "--append", "--resume"])
        if rc:
            raise SystemExit(rc)
    else:
        print("kvcache calibrate: step 2/2, no finite threshold inside the measured range: "
              "no boundary check needed", file=sys.stderr)
    if os.path.exists(check_path):
        with open(check_path) as f:
            run["results"] = run["results"] + json.load(f)["results"]
    return run


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .breakeven import fit_from_longdoc, load_table

    if args.from_longdoc:
        with open(args.from_longdoc) as f:
            run = json.load(f)
    else:
        if not args.root:
            print("kvcache calibrate: --model needs --root (a directory on the cache's disk)",
                  file=sys.stderr)
            return 2
        run = _calibrate_measure(args)
    table = fit_from_longdoc(run)
    if os.path.exists(args.out) and not args.force:
        old = load_table(args.out)
        if (old.model, old.gpu) != (table.model, table.gpu):
            print(f"kvcache calibrate: {args.out} holds a table for model {old.model!r} on "
                  f"{old.gpu!r}; refusing to overwrite it with {table.model!r} on "
                  f"{table.gpu!r} (use --force)", file=sys.stderr)
            return 2
    with open(args.out, "w") as f:
        json.dump(table.to_json(), f, indent=1)
    print(json.dumps({"model": table.model, "gpu": table.gpu,
                      "min_prefix_tokens": table.thresholds}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache", description="py-kvcache: external KV cache for vLLM (DRAM + NVMe).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_config_epilog())
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                   help="print py-kvcache's version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser(
        "storage", help="I/O engines x request size x depth; metadata rates",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure read/write throughput of the raw O_DIRECT baseline (plain "
        "preadv/pwritev threads), the io_uring engine, the POSIX fallback and the full "
        "reactor at request sizes 4 KiB..28 MiB and several depths, all in one run; then "
        "Layout lookup and publish rates with 10k/100k/1M files in the root. Writes JSON, "
        "a Markdown table (.md) and a plot (.png) next to --json.")
    bs.add_argument("--root", default="./.bench-root",
                    help="directory on the filesystem to measure (default ./.bench-root)")
    bs.add_argument("--quick", action="store_true",
                    help="fewer depths, one repeat, metadata up to 100k files")
    bs.add_argument("--no-metadata", action="store_true", help="skip the metadata part")
    bs.add_argument("--json", help="write the results to this JSON file")
    bs.set_defaults(func=_cmd_bench_storage)

    ins = sub.add_parser("inspect", help="namespaces, files and bytes under a cache root")
    ins.add_argument("root")
    ins.add_argument("--json", help="also write the report to this file")
    ins.add_argument("--allow-foreign-root", action="store_true",
                     help="inspect a root owned by another user (refused by default)")
    ins.set_defaults(func=_cmd_inspect)

    gc = sub.add_parser("gc", help="collect temp files of dead writers, resync the ledger")
    gc.add_argument("root")
    gc.add_argument("--max-age", type=float, default=600.0,
                    help="also remove any temp file older than this many seconds")
    gc.add_argument("--allow-foreign-root", action="store_true",
                    help="collect in a root owned by another user (refused by default)")
    gc.set_defaults(func=_cmd_gc)

    cal = sub.add_parser(
        "calibrate", help="measure and fit a break-even table (breakeven_table)",
        description="Measure (--model) or read (--from-longdoc) cold TTFT (recompute) and "
        "hit TTFT from the DRAM tier and from disk (fresh process, page cache dropped) over "
        "document sizes, on the target GPU and model, each engine in its own process; fit "
        "per tier the smallest reusable prefix for which loading beats recomputing at every "
        "larger measured size (null: never); then measure extra sizes just below and above "
        "each finite threshold and refit. Progress goes to stderr; every finished "
        "configuration is saved in <out>.run.json / <out>.check.json, so running the same "
        "command again resumes. Refuses to overwrite a table of another model or GPU "
        "without --force.")
    src = cal.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory to measure (vLLM, dummy weights ok)")
    src.add_argument("--from-longdoc", help="fit from an existing long-document run JSON")
    cal.add_argument("--root", help="with --model: cache roots for the measurement (on the "
                     "disk the cache will use)")
    cal.add_argument("--tokens", default="1024,4096,16384,65536",
                     help="with --model: document sizes (default 1024,4096,16384,65536)")
    cal.add_argument("--docs", type=int, default=2, help="with --model: documents per size")
    cal.add_argument("--repeats", type=int, default=2, help="with --model: hits per document")
    cal.add_argument("--no-check", action="store_true",
                     help="with --model: skip the boundary check")
    cal.add_argument("--out", required=True, help="table file to write")
    cal.add_argument("--force", action="store_true", help="overwrite another model's table")
    cal.set_defaults(func=_cmd_calibrate)

    pv = sub.add_parser(
        "patch-vllm", help="apply / check / reverse the vLLM preload patches",
        description="Apply py-kvcache's patch series (vllm_patches/v<version>/series) to a vLLM "
        "checkout, a site-packages directory holding vllm/, or the vllm package directory. "
        "Idempotent and all-or-nothing; another vLLM version is refused. Exit status with "
        "--check: 0 all applied, 1 not (fully) applied, 2 error.")
    pv.add_argument("--target", required=True, help="vLLM checkout or installed package dir")
    g = pv.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="report the state, change nothing")
    g.add_argument("--reverse", action="store_true", help="remove the patches")
    pv.add_argument("--vllm-version", help="override the detected vLLM version")
    pv.set_defaults(func=_cmd_patch_vllm)
    return p


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point. Ordinary mistakes (a missing path, an unreadable or read-only root, a
    bad config) print one line naming the problem and return 2; ``-v`` shows the
    traceback too."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"kvcache: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if args.verbose:
            raise
        what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        print(f"kvcache {args.cmd}: {what}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvcache {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
