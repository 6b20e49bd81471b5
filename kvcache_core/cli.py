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


def _paras(*paras: str) -> str:
    """Help text paragraphs wrapped for RawDescriptionHelpFormatter."""
    import textwrap

    return "\n\n".join(textwrap.fill(p, 79) for p in paras)


def _cmd_bench_storage(args: argparse.Namespace) -> int:
    import signal

    from .bench import storage

    def term(signum, _frame):  # SIGTERM/SIGHUP: unwind like Ctrl-C, so the scratch goes
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, term)
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
    """Read-only: never opens a Layout (which would create a writer lock, ``.usage`` or
    ``meta.json`` and collect dead writers); walks with scandir/lstat only."""
    from . import admin

    if not os.path.isdir(args.root):
        print(f"kvcache inspect: {args.root} is not a directory", file=sys.stderr)
        return 2
    root = os.path.abspath(args.root)
    owner = os.stat(root).st_uid
    if owner != os.geteuid() and not args.allow_foreign_root:
        raise ConfigError(f"py-kvcache root_dir '{args.root}' is owned by uid {owner}, not by "
                          f"this process's uid {os.geteuid()}: refusing a cache root another "
                          "user controls (--allow-foreign-root, as allow_foreign_root: true)")
    report = []
    for name, meta in _iter_namespaces(root):
        ns, why = admin.namespace_of(name, meta)
        if ns is None:
            raise ConfigError(f"namespace directory {name} does not match its meta.json "
                              f"({why})")
        base = os.path.join(root, name)
        files, nbytes, walk = admin.usage(base)
        live, _unknown = admin.live_writers(base)
        report.append({"namespace": name, **meta, "files": files, "bytes": nbytes,
                       "ledger_bytes": admin.read_ledger(base),
                       "temp_files": len(walk.temps), "live_writers": len(live),
                       "symlinks_skipped": len(walk.links)})
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0


def _inside(path: str, root: str) -> bool:
    path = os.path.realpath(path)
    root = os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _cmd_verify(args: argparse.Namespace) -> int:
    from . import admin

    root = admin.check_root(args.root)
    if args.json and _inside(os.path.dirname(os.path.abspath(args.json)), root):
        raise admin.UsageError(f"--json {args.json} is inside the root (verify never "
                               "writes there)")
    dirs, links = admin.namespace_entries(root)
    if args.namespace:
        if args.namespace in {os.path.basename(p) for p in links}:
            raise admin.UsageError(f"{os.path.join(root, args.namespace)} is a symbolic "
                                   "link (never followed)")
        dirs = [d for d in dirs if d.name == args.namespace]
        if not dirs:
            raise admin.UsageError(f"no namespace {args.namespace} under {root}")
        links = []
    progress = admin.Progress("kvcache verify", args.quiet)
    reps = [admin.verify_namespace(d, progress) for d in dirs]
    progress.done()
    tot = {k: sum(len(r[k]) if isinstance(r[k], list) else r[k] for r in reps)
           for k in ("files", "bytes", "ok", "corrupt", "unreadable", "temp_files",
                     "symlinks_skipped")}
    tot["symlinks_skipped"] += len(links)
    errors = sum(1 for r in reps if r["error"])
    clean = not (tot["corrupt"] or tot["unreadable"] or errors)
    for r in reps:
        print(f"{r['namespace']} (model {r['model']}): {r['files']} files, {r['bytes']} "
              f"bytes: {r['ok']} ok, {len(r['corrupt'])} corrupt, {len(r['unreadable'])} "
              f"unreadable, {len(r['temp_files'])} temp files, "
              f"{len(r['symlinks_skipped'])} symlinks skipped")
        if r["error"]:
            print(f"  not checked: {r['error']}")
        for what in ("corrupt", "unreadable"):
            for x in r[what]:
                print(f"  {what}: {x['path']}: {x['reason']}")
        for p in r["temp_files"]:
            print(f"  temp file: {p}")
        for p in r["symlinks_skipped"]:
            print(f"  symlink skipped: {p}")
    for p in links:
        print(f"symlink skipped: {p}")
    print(f"total: {len(reps)} namespaces, {tot['files']} files, {tot['bytes']} bytes: "
          f"{tot['ok']} ok, {tot['corrupt']} corrupt, {tot['unreadable']} unreadable, "
          f"{tot['temp_files']} temp files, {tot['symlinks_skipped']} symlinks skipped"
          + (f", {errors} namespaces not checked" if errors else "")
          + ("" if clean else ": NOT OK"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"root": root, "ok": clean, "totals": tot, "namespaces": reps,
                       "symlinks_skipped": links}, f, indent=1)
    return 0 if clean else 1


def _cmd_purge(args: argparse.Namespace) -> int:
    from . import admin

    root = admin.check_root(args.root, args.allow_foreign_root)
    dirs, links = admin.namespace_entries(root)
    chosen: list[tuple[os.DirEntry, str]] = []  # (entry, model)
    for name in args.namespace or []:
        if not admin.NS_DIR_RE.fullmatch(name):
            raise admin.UsageError(f"{name!r} is not a namespace directory name "
                                   "(v<N>-<16 hex digits>, see kvcache inspect)")
        if name in {os.path.basename(p) for p in links}:
            raise admin.UsageError(f"{os.path.join(root, name)} is a symbolic link (never "
                                   "followed; remove the link itself if it must go)")
        if not any(d.name == name for d in dirs):
            raise admin.UsageError(f"no namespace {name} under {root}")
    for d in dirs:
        meta, _why = admin.read_meta(d.path)
        model = meta.get("model") if meta else None
        if (args.all or (args.namespace and d.name in args.namespace)
                or (args.model is not None and isinstance(model, str)
                    and args.model in model)):
            chosen.append((d, model))
    for p in links:
        print(f"skipped {p}: symbolic link (never followed)")
    leftovers = []
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith(admin.PURGE_PREFIX) and e.is_dir(follow_symlinks=False):
                leftovers.append(e)
    plan = []
    total = 0
    for d, model in chosen:
        files, nbytes = admin.tree_usage(d.path)
        live, unknown = admin.live_writers(d.path)
        plan.append((d, model, files, nbytes, live, unknown))
        total += nbytes
    for e in leftovers:
        files, nbytes = admin.tree_usage(e.path)
        plan.append((e, "leftover of an interrupted purge", files, nbytes, [], []))
        total += nbytes
    if not plan:
        print("nothing to purge")
        return 0
    verb = "would remove" if args.dry_run or not args.yes else "removing"
    for d, model, files, nbytes, live, unknown in plan:
        busy = (f"; {len(live)} live writers" if live else "") + (
            f"; {len(unknown)} writers of unknown state" if unknown else "")
        print(f"{verb} {d.path} (model {model}): {files} files, {nbytes} bytes{busy}")
    busy = [(d, live + unknown) for d, _m, _f, _b, live, unknown in plan if live or unknown]
    if args.dry_run:
        print(f"dry run: {len(plan)} namespaces, {total} bytes would be removed; nothing "
              "deleted" + ("" if not busy or args.force else
                           " (namespaces with live writers need --force)"))
        return 0
    if not args.yes:
        raise admin.UsageError(f"refusing to delete {len(plan)} namespaces ({total} bytes) "
                               "without --yes (--dry-run lists them)")
    if busy and not args.force:
        d, who = busy[0]
        raise admin.UsageError(f"{d.path} has {len(who)} live writers ({', '.join(who)}): "
                               "stop them or use --force; nothing deleted")
    for d, _model, _files, nbytes, _live, _unknown in plan:
        admin.remove_tree(root, d.path)
        print(f"removed {d.path}: {nbytes} bytes")
    print(f"removed {len(plan)} namespaces, {total} bytes")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    total = 0
    for name, meta in _iter_namespaces(args.root):
        # collects dead writers' temp files; never follows a symbolic link
        lay = _open_layout(args.root, name, meta, args.allow_foreign_root)
        total += lay.stats.temp_collected + lay.collect_stale_temps(args.max_age)
        with lay.ledger.locked():  # walk + set under the lock: no publish in between
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
        vllm_v, series_v = patching.chosen_series(args.target, args.vllm_version)
        if patching.version_key(vllm_v) != patching.version_key(series_v):
            print(f"kvcache patch-vllm: vLLM {vllm_v}: using series v{series_v} (the newest "
                  "series not newer than it; see docs/patch-compat.md)", file=sys.stderr)
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
    note = None if args.reverse else patching.runtime_note(vllm_v)
    if note:
        print(f"kvcache patch-vllm: note: {note}", file=sys.stderr)
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
        "a Markdown table (.md) and a plot (.png) next to --json. Prints first how many "
        "bytes it will write and roughly how long it takes (from a short probe).")
    bs.add_argument("--root", default="./.bench-root",
                    help="existing directory on the filesystem to measure (default "
                    "./.bench-root); the benchmark works in a scratch directory inside it "
                    "and removes it at the end, on an error, Ctrl-C or SIGTERM")
    bs.add_argument("--create", action="store_true",
                    help="create --root if it does not exist (its parent must) and remove "
                    "it again at the end; without it a missing root is refused")
    bs.add_argument("--quick", action="store_true",
                    help="fewer depths, one repeat, metadata up to 100k files")
    bs.add_argument("--no-metadata", action="store_true", help="skip the metadata part")
    bs.add_argument("--json", help="write the results to this JSON file")
    bs.set_defaults(func=_cmd_bench_storage)

    ins = sub.add_parser(
        "inspect", help="namespaces, files and bytes under a cache root (read-only)",
        description="Per namespace: its meta.json, published files and bytes, the .usage "
        "ledger, temp files, live writers and symbolic links skipped, as JSON. Read-only: "
        "creates, changes and removes nothing in the root (no lock, ledger or meta file).")
    ins.add_argument("root", help="the cache root (root_dir)")
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

    ver = sub.add_parser(
        "verify", help="check every published block's header and checksum (read-only)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paras(
            "Read every published block file under ROOT (or one namespace) and check its "
            "header (magic, format version, header checksum, geometry and namespace against "
            "the namespace's meta.json, the key hashing to the file name and shard "
            "directory, the file size) and its payload checksum. Reports per namespace: "
            "files, bytes, ok, corrupt and unreadable files (with paths and reasons), temp "
            "files left behind and symbolic links skipped (never followed).",
            "Read-only: no ledger rescan; no meta.json, lock or other file is created, "
            "changed or removed (blocks are read with O_NOATIME where allowed). A progress "
            "line goes to stderr every second (and at the end for 1,000 files or more).",
            "exit status: 0 everything checked is ok (temp files and skipped links are only "
            "reported), 1 a corrupt or unreadable file or a namespace that cannot be checked "
            "(bad meta.json), 2 usage error (missing root, not a cache root, unknown "
            "namespace)."))
    ver.add_argument("root", metavar="ROOT", help="the cache root (root_dir)")
    ver.add_argument("--namespace", metavar="NS",
                     help="check only this namespace directory (v<N>-<digest>, see "
                     "kvcache inspect)")
    ver.add_argument("--json", metavar="OUT",
                     help="also write the full report (every path and reason) to this file "
                     "(outside the root)")
    ver.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ver.set_defaults(func=_cmd_verify)

    pu = sub.add_parser(
        "purge", help="delete whole namespaces (by name, by model, or all)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paras(
            "Delete the directory tree of every matching namespace under ROOT (matched by "
            "directory name, by the model field of its meta.json, or all). Each is renamed "
            "inside ROOT first (a writer starting meanwhile gets a fresh namespace) and then "
            "removed without following any symbolic link; a namespace directory that is "
            "itself a link is skipped; nothing outside ROOT is touched. Leftovers of an "
            "interrupted purge (.kvcache-purge.*) are removed too.",
            "A namespace with a live writer (a process holding its lock in .writers: the "
            "check kvcache gc makes before collecting) is refused, and then nothing at all "
            "is deleted, unless --force. Without --yes nothing is deleted (exit 2) unless "
            "--dry-run, which lists what would go and how many bytes.",
            "exit status: 0 done (or nothing matched), 2 refused or usage error."))
    what = pu.add_mutually_exclusive_group(required=True)
    what.add_argument("--namespace", metavar="NS", action="append",
                      help="the namespace directory v<N>-<digest> (see kvcache inspect); "
                      "repeat for several")
    what.add_argument("--model", metavar="SUBSTRING",
                      help="every namespace whose meta.json model contains SUBSTRING "
                      "(case-sensitive)")
    what.add_argument("--all", action="store_true", help="every namespace under ROOT")
    pu.add_argument("root", metavar="ROOT", help="the cache root (root_dir)")
    pu.add_argument("--dry-run", action="store_true",
                    help="list the namespaces and bytes that would be removed; delete nothing")
    pu.add_argument("--yes", action="store_true", help="really delete (required unless "
                    "--dry-run)")
    pu.add_argument("--force", action="store_true",
                    help="also delete namespaces with live writers (their stores fail and "
                    "their loads miss until they reopen the namespace)")
    pu.add_argument("--allow-foreign-root", action="store_true",
                    help="purge in a root owned by another user (refused by default)")
    pu.set_defaults(func=_cmd_purge)

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
        "The series is the one for the detected vLLM version, else the newest older one "
        "(0.27.1 -> v0.26.0); a version older than every series is refused. Idempotent and "
        "all-or-nothing (no fuzz). Exit status with --check: 0 all applied, 1 not (fully) "
        "applied, 2 error.")
    pv.add_argument("--target", required=True, help="vLLM checkout or installed package dir")
    g = pv.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="report the state, change nothing")
    g.add_argument("--reverse", action="store_true", help="remove the patches")
    pv.add_argument("--vllm-version", help="override the detected vLLM version")
    pv.set_defaults(func=_cmd_patch_vllm)

    from .replay import add_parsers as _add_replay_parsers  # replay, workload (issue 11)

    _add_replay_parsers(sub)
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
    from .admin import UsageError

    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"kvcache {args.cmd}: {e}", file=sys.stderr)
        return 2
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
