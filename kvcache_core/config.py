"""Configuration of the storage engine, validated once at start.

Every key is documented in :data:`KEY_HELP` (the ``--help`` text of the CLI and the
README table come from it). Unknown keys and bad values raise :class:`ConfigError`
naming the key, so a typo fails at start instead of silently running a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid."""


def default_root_dir() -> str:
    """The default ``root_dir``: private to the user, never a shared directory such as
    /tmp: ``$XDG_CACHE_HOME/py-kvcache`` when XDG_CACHE_HOME is an absolute path, else
    ``~/.cache/py-kvcache`` (created ``dir_mode``, 0700 by default, by the layout)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "py-kvcache")


def check_mode(value: Any, key: str, owner_bits: int) -> int:
    """Parse a permission mode given as an int (``0o750``) or an octal string (``"0750"``,
    ``"750"``, ``"0o750"``) and return it as an int.

    Only permission bits (no setuid/setgid/sticky) and the owner keeps ``owner_bits``
    (rw for files, rwx for directories); anything else raises :class:`ConfigError`
    naming ``key``."""
    mode = value
    if isinstance(value, str):
        text = value.strip().lower()
        text = text[2:] if text.startswith("0o") else text
        try:
            mode = int(text, 8) if text else None
        except ValueError:
            mode = None
    if not isinstance(mode, int) or isinstance(mode, bool):
        raise ConfigError(f"py-kvcache config key '{key}': must be an octal permission mode "
                          f"such as 0o700 or \"0700\" (got {value!r})")
    if mode & ~0o777 or mode < 0:
        raise ConfigError(f"py-kvcache config key '{key}': only permission bits (0..0o777) "
                          f"are allowed (got {value!r})")
    if mode & owner_bits != owner_bits:
        raise ConfigError(f"py-kvcache config key '{key}': the owner must keep "
                          f"{oct(owner_bits)} (got {value!r})")
    return mode


KEY_HELP: dict[str, str] = {
    "root_dir": "Directory that holds the cache files (shared by every vLLM instance using "
    "the same model). Created if missing (dir_mode); must be writable and owned by this "
    "user (see allow_foreign_root). Default: $XDG_CACHE_HOME/py-kvcache or "
    "~/.cache/py-kvcache, private to the user.",
    "dir_mode": "Permission mode of every directory the cache creates (octal int or string, "
    "e.g. \"0750\"); the owner must keep rwx. Default 0700: only this user. A group mode "
    "shares the cache with the group (docs/security.md: members can read and forge blocks).",
    "file_mode": "Permission mode of every file the cache creates (blocks, temp files, "
    "meta.json, .usage, locks; octal int or string, e.g. \"0640\"); the owner must keep rw. "
    "Default 0600: only this user.",
    "allow_foreign_root": "Use a root_dir owned by another user (refused by default: whoever "
    "owns the root can read, replace or forge every block; docs/security.md).",
    "staging_bytes": "Bytes of the page-locked staging pool used for transfers (loads, stores, "
    "preloads). Rounded down to whole slots; must hold at least io_depth + copy_headroom "
    "slots. Without "
    "a DRAM tier it is also the write-back buffer of stores: a store never waits for the "
    "disk, so a chunk that finds no free slot above the io_depth reserved for loads is "
    "dropped (counted as stores_dropped_backpressure).",
    "io_depth": "Disk reads/writes in flight at once (io_uring queue depth). Also the number "
    "of slots reserved for foreground (on-demand) work.",
    "lookahead": "Asynchronous file opens allowed ahead of reads.",
    "preload_depth": "Speculative (preload) disk reads open or in flight at once, each "
    "into a staging slot above the io_depth foreground reservation and only while no "
    "on-demand load waits for a disk unit; a preload whose file is open but not yet read "
    "is put back when an on-demand load arrives. 1 (default) is the seed paper's policy "
    "(one speculative read, yield to demand); more keeps a fast disk busier while "
    "requests queue (issue 10's A/B: scripts/h200_runs.sh preload with KVEXTRA). Capped "
    "at io_depth - 1, so that speculative reads stuck on a slow disk always leave "
    "on-demand loads a unit. 1..64.",
    "preload_keep_s": "Seconds a staged preload that no load has claimed yet is kept from "
    "other preloads (default 0 = off: any preload may evict it; 30 matches how long the "
    "scheduler counts a block as staged; at most 3600). When every staging slot a preload "
    "could take holds such a block, the preload is dropped unread (counter "
    "preloads_dropped_full) instead of evicting it: the blocks planned first (the head of "
    "vLLM's queue, the start of a prefix) stay staged for their requests rather than being "
    "read and then evicted when more is planned than staging holds (counter "
    "preloads_wasted: 28 of 50 staged in two of the forty-third session's three "
    "SCBench-like calls on an H100). On-demand loads and stores may always reclaim a "
    "staged slot. CPU machine (docs/results/cpu/preload-keep-s43.md): 30 wasted fewer "
    "preloads (3 against 4, median of three runs) with the same blocks read, the mean TTFT "
    "within the run-to-run spread; off until a GPU run decides.",
    "copy_headroom": "Extra slots beyond io_depth that keep the disk busy while device "
    "copies hold slots. staging_bytes must cover io_depth + copy_headroom slots.",
    "dram_cache_bytes": "Bytes of additional slots that retain finished blocks as a DRAM "
    "cache tier (0 disables the DRAM tier). Stores are copied there and written to disk "
    "from there in the background (write-back buffer).",
    "eviction_policy": "DRAM tier replacement policy: 'lru-admit' (default: LRU plus a "
    "frequency filter on new blocks that turns itself on only while it measures more hits "
    "than LRU, e.g. loops over more contexts than the tier holds), 'lru' or 'arc'.",
    "writeback_max_fraction": "Share of the DRAM tier that stores may hold while their "
    "files are still being written (write-back). Beyond it a new store still fills a "
    "DRAM-tier slot but writes no file (counted as stores_writeback_full), so a disk that "
    "falls behind never pins the tier with pending writes and disk hits can still be "
    "promoted into it. 'auto' (default since the thirty-third session; 0.5 before) = 0.1 "
    "while the engine is busy (a disk load in flight, or, with the preload patches and "
    "preload_lookahead > 0, requests waiting in the scheduler's queue now or less than 2 s "
    "ago) and 0.5 otherwise: "
    "with write_depth_reading 'auto' no file is started while loads read, and the small "
    "share keeps the blocks waiting for their file from crowding out the blocks queued "
    "requests read, while a store burst on an idle engine keeps its files. Judged by disk "
    "loads alone (the thirty-third session's 'auto') it let the write-back take half the "
    "tier between loads of a queued run: 9.7-10.5 s and 26.4 GB read on an H100 against "
    "4.9-5.1 s and 14.2 GB with a fixed 0.1. A fixed 0.1 (with write_depth_reading 0 and "
    "preload_protect) measured 0.49-0.64x native tiered FS's mean TTFT on the queued mixed "
    "16 x 40k (H100 and H200; the old defaults 1.09-1.19x) and 2.02 against 3.31 s on the "
    "SCBench-like loop (5.2 against 30.2 GB read), but a fixed 0.1 also cost files on an "
    "idle disk (a 64k storing request kept 270 of 512 blocks on disk against 335; a "
    "3-block store on an 8-block tier 1 of 3), hence 'auto'. Its queue rule on an H100 "
    "(thirty-fifth session, three calls, A and B interleaved): 5.3-5.8 s mean TTFT "
    "against 5.9-6.1 s for a fixed 0.1 (0.92x, median of the within-call ratios; 14.1 "
    "against 13.9 GB read) and 0.57x native tiered FS. "
    "Or a number in (0, 1] for a fixed share; writeback_flush writes such blocks later.",
    "writeback_flush": "Write such DRAM-only blocks (see writeback_max_fraction) to disk "
    "later, oldest first, whenever the write-back has room again, so that a block evicted "
    "from the DRAM tier is still a disk hit (for this and every other instance sharing "
    "root_dir) instead of a recompute. Costs disk bandwidth that loads may want; off by "
    "default because on the H200 reference disk (1.5-2.1 GB/s, where a 3B model "
    "recomputes 32k tokens faster than it reads them) it made the measured workloads "
    "slower (docs/results/h200/README.md). true or false.",
    "writeback_defer_s": "Seconds after the last store or load was handed to the I/O "
    "reactor (vLLM has just run a prefill, or a hit is loading) during which no new "
    "write-back file is started, unless half the DRAM tier (at least 8 blocks) waits to be "
    "written: the background disk writes then keep out of the way of the steps that are "
    "computing or loading. 0 (default) starts them at once. For the H200 A/B of issue 9's "
    "storing requests (scripts/h200_runs.sh vab; the env KVCACHE_WRITEBACK_DEFER_MS of "
    "older runs does the same when this key is 0). 0..10.",
    "write_depth_reading": "Most write-back files started while the reactor reads (an "
    "on-demand load or a preload waiting or in flight): 'auto' (default) = 0 with a DRAM "
    "tier (dram_cache_bytes > 0; since the thirty-third session), else the usual write "
    "depth, io_depth // 2 in serving (without a tier the pending writes would hold the "
    "staging pool and drop stores); 0 starts none until the reads are done; 1..io_depth "
    "caps them. On a disk that both reads loads and writes stores, the reads of waiting "
    "requests then get the disk's bandwidth and the writes wait (the DRAM tier holds their "
    "blocks; past writeback_max_fraction new stores keep no file, as when the disk is "
    "behind). Writes already started finish. For the GPU A/B of the queued mixed "
    "workload, where the disk was busy the whole run with about as many bytes written as "
    "read (twenty-seventh session). With 0, keep writeback_max_fraction small (e.g. 0.1): "
    "the blocks waiting for their file stay pinned in the DRAM tier until the reads end, "
    "and at the default 0.5 they left the H100 run's tier less than one of the documents "
    "the queued requests reused (read 14.7 GB; docs/results/cpu/dram-policy-sim-s27.md: "
    "a tier below one document serves almost nothing). Measured on the H200 (thirty-second "
    "session, queued mixed 16 x 40k from equal disk contents): with "
    "writeback_max_fraction=0.1, preload_protect and preload, 0.64x native tiered FS's "
    "mean TTFT where the defaults were 1.09-1.19x (docs/operator-guide.md, 'Queued "
    "long-context traffic'); on an H100 (thirty-third session) 0.49-0.56x, with no loss "
    "on issue 9's storing requests and DRAM hits and a win on the SCBench-like loop: the "
    "default since then (with a DRAM tier), with writeback_max_fraction 'auto'.",
    "disk_admission": "Which stored blocks get a file: 'all' (default: every stored block, "
    "written in the background) or 'reuse' (a block's first store keeps it in the DRAM "
    "tier only; its file is written once a request reads it from there, or when it is "
    "stored again after leaving the tier; without a DRAM-tier slot a first store is not "
    "stored). 'reuse' spares the disk (and its write endurance) the blocks that are never "
    "read again, e.g. one-off chat prompts (ShareGPT on the H200: ~480 files of 28 MiB "
    "written per 500 requests for 5-10 disk hits, and decode slower while they are "
    "written, docs/results/h200/README.md); the price is one more recompute of a block "
    "whose first reuse comes after the DRAM tier dropped it (by simulation 14-30 points "
    "more prompt recompute on long-context replays, where disk_min_prefix_tokens=2048 "
    "saves as many ShareGPT files at no such cost: docs/results/cpu/disk-admission-sim.md; "
    "use 'reuse' for one-off long documents). Counters "
    "stores_disk_deferred, stores_disk_not_admitted, flushes_reused.",
    "block_size": "Tokens per storage block (one file); a multiple of vLLM's GPU block size.",
    "max_disk_bytes": "Upper bound on cache bytes under root_dir for this model namespace, "
    "shared by all processes; least-recently-used files are evicted beyond it. 0 = unbounded.",
    "durable": "fdatasync each file before publishing it (survives power loss; slower).",
    "direct_io": "'auto' (probe the filesystem), 'on' (require O_DIRECT) or 'off'.",
    "publish_method": "How a finished block file gets its final name: 'link' (hard link of "
    "the complete temp file; fails if the name exists), 'rename' (existence check + rename "
    "of the complete temp file under the ledger lock; for distributed filesystems whose "
    "hard links are not atomic across clients, e.g. a GlusterFS distribute volume) or "
    "'auto' (rename when root_dir is on a FUSE filesystem, else link). Both never show a "
    "partial file and the first writer of a block wins. Default 'auto' (docs/scale-out.md).",
    "engine": "'auto' (io_uring, POSIX fallback with a warning), 'io_uring' or 'posix'.",
    "io_async": "io_uring only: 'on' hands every disk read and write to the kernel's "
    "worker threads (IOSQE_ASYNC), so submitting one costs the reactor thread microseconds "
    "instead of pinning the buffer's pages and building its block requests itself while "
    "holding the Python GIL that vLLM's engine thread needs (CPU machine, 64 O_DIRECT "
    "reads of 29 MB through the reactor: 12.5 ms in submit, 3.4 ms the longest, against "
    "1.0 ms and 0.7 ms with 'on', at 2.5 % lower GB/s: docs/results/cpu/io-async-s36.md); "
    "'auto' (default): only without O_DIRECT, where an "
    "inline read could block in the page cache; 'off': never. Counters: the reactor "
    "timing's submit_s / submit_max_s.",
    "verify_checksum": "Check the xxh3-64 of every payload read from disk (corrupt = miss).",
    "io_timeout_s": "Deadline of one file operation (open, read, write, fsync, close), in "
    "seconds. A load whose file operation passes it is a miss (vLLM recomputes), a store is "
    "dropped, and a request older than twice the deadline fails what it has not started; "
    "a hung filesystem (network mount, FUSE, a FIFO) therefore never hangs vLLM. The stuck "
    "operation keeps its slot until the kernel ends it. 0 disables (not recommended). "
    "Default 30.",
    "switch_interval_s": "Python interpreter switch interval (seconds) the worker sets in "
    "vLLM's process when the current one is larger: the I/O reactor is a Python thread and "
    "gets the GIL back from vLLM's busy engine loop within this time after each completion "
    "(0.0005 s; CPython's default 0.005 s throttled disk loads 4x, scripts/bench_gil.py). "
    "A smaller interval also makes vLLM's own thread hand the GIL over more often. 0 leaves "
    "the interpreter's setting alone. Default 0.0005.",
    "switch_interval_scope": "When switch_interval_s applies: 'process' (set once when the "
    "worker starts, for the life of vLLM's process) or 'busy' (only while the reactor has a "
    "load or store in flight, files of a store included; the interpreter's own interval "
    "when it is idle, so that vLLM's engine loop and its other Python threads are not made "
    "to hand the GIL over every 0.5 ms while py-kvcache has nothing to do). An H200 run "
    "that lowered it for disk loads only made stores and DRAM hits slower. Default "
    "'process'.",
    "store_copy_wait": "How the I/O reactor learns that a store's device->host copy is "
    "done: 'poll' (default: it wakes every 1 ms while store copies are in flight and checks "
    "their CUDA events, taking the GIL from vLLM's engine thread each time) or 'block' (a "
    "helper thread waits on each copy's event with the GIL released and wakes the reactor "
    "once per copy). 'block' is for the A/B of issue 9's no-hit decode cost (the counters "
    "reactor_iterations / reactor_step_us show the wake-ups); it is not yet measured on a "
    "GPU. No effect without CUDA.",
    "dram_load_copy": "How a DRAM-tier hit is copied into vLLM's KV cache: 'dma' (one "
    "cuMemcpyBatchAsync on the GPU's copy engines: one descriptor per contiguous run of GPU "
    "blocks, so a request whose blocks vLLM handed out in reverse or scattered order needs "
    "one descriptor per block and layer and the host thread feeds the copy engines for "
    "the copy's whole duration), 'kernel' (vLLM's Triton gather kernel: GPU threads read "
    "the pinned DRAM tier directly, one launch whatever the descriptor count) or 'auto' "
    "(the kernel when the descriptors average below 256 KiB, else dma). On the H200 the "
    "kernel reads at 51 GB/s and returns in 1-2 ms where dma with per-block descriptors "
    "held vLLM's engine thread for the whole 64k copy (docs/results/h200/README.md, "
    "nineteenth session). Falls back to 'dma' with a warning where Triton cannot run. No "
    "effect without CUDA. Default 'auto'.",
    "store_copy": "How a store's device->host copy (vLLM's KV cache into the staging "
    "pool or the DRAM tier) is issued, by the I/O reactor thread: 'dma' (one "
    "cuMemcpyBatchAsync with one descriptor per contiguous run of GPU blocks; blocks in "
    "reverse or scattered order need one per block and layer, and the reactor thread "
    "feeds the copy engines for the copy's whole duration: 113 ms of host time for a 7 GiB "
    "copy in 64 KiB pieces on the H200), 'kernel' (vLLM's Triton gather kernel: GPU "
    "threads write the pinned pool directly, one launch, 1.6 ms of host time at 52 GB/s "
    "in the same test, docs/results/h200/README.md, twenty-first session) or 'auto' (the "
    "kernel when the descriptors average below 256 KiB, else dma), the same rule as "
    "dram_load_copy. Default 'dma': in the store-side A/B on the H200 (scripts/h200_runs.sh "
    "scab, twenty-second session, 3 rounds) 'auto' halved the reactor's host time issuing "
    "store copies but made no storing request consistently faster. Falls back to 'dma' "
    "with a warning where Triton cannot run. No effect without CUDA.",
    "integrity_key_file": "Path of a file holding a secret (>= 16 bytes; not readable by "
    "every user) shared by the processes that trust each other. Every block then carries a "
    "keyed BLAKE3 over header and payload, and a block that does not verify (forged by "
    "someone with write access to root_dir but not the key, or written without a key) is a "
    "miss, never a hit. Keyed instances use their own namespace (named by a public id of "
    "the key). Costs one BLAKE3 pass per block written and read. Unset: no keyed check "
    "(docs/security.md).",
}


@dataclass
class StorageConfig:
    """Validated settings of the storage engine (see :data:`KEY_HELP`)."""

    root_dir: str = field(default_factory=default_root_dir)
    dir_mode: int = 0o700
    file_mode: int = 0o600
    allow_foreign_root: bool = False
    staging_bytes: int = 512 * MiB
    io_depth: int = 8
    lookahead: int = 8
    preload_depth: int = 1
    preload_keep_s: float = 0.0
    copy_headroom: int = 4
    dram_cache_bytes: int = 0
    eviction_policy: str = "lru-admit"
    writeback_max_fraction: float | str = "auto"
    writeback_flush: bool = False
    writeback_defer_s: float = 0.0
    write_depth_reading: int | str = "auto"
    disk_admission: str = "all"
    block_size: int = 256
    max_disk_bytes: int = 0
    durable: bool = False
    direct_io: str = "auto"
    publish_method: str = "auto"
    engine: str = "auto"
    io_async: str = "auto"
    verify_checksum: bool = True
    io_timeout_s: float = 30.0
    switch_interval_s: float = 0.0005
    switch_interval_scope: str = "process"
    store_copy_wait: str = "poll"
    dram_load_copy: str = "auto"
    store_copy: str = "dma"
    integrity_key_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid key. Normalises
        ``dir_mode`` / ``file_mode`` given as octal strings to ints."""

        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"py-kvcache config key '{key}': {msg} "
                                  f"(got {getattr(self, key)!r})")

        for key in ("staging_bytes", "io_depth", "lookahead", "copy_headroom",
                    "dram_cache_bytes", "block_size", "max_disk_bytes", "preload_depth"):
            v = getattr(self, key)
            need(isinstance(v, int) and not isinstance(v, bool), key, "must be an integer")
        need(isinstance(self.root_dir, str) and self.root_dir != "", "root_dir",
             "must be a non-empty path")
        need(isinstance(self.io_timeout_s, (int, float)) and not isinstance(
            self.io_timeout_s, bool) and 0 <= self.io_timeout_s <= 3600, "io_timeout_s",
             "must be a number of seconds in 0..3600 (0 = no deadline)")
        need(isinstance(self.switch_interval_s, (int, float)) and not isinstance(
            self.switch_interval_s, bool) and 0 <= self.switch_interval_s <= 0.1,
             "switch_interval_s", "must be a number of seconds in 0..0.1 (0 = leave it)")
        need(self.switch_interval_scope in ("process", "busy"), "switch_interval_scope",
             "must be 'process' or 'busy'")
        need(self.store_copy_wait in ("poll", "block"), "store_copy_wait",
             "must be 'poll' or 'block'")
        for key in ("dram_load_copy", "store_copy"):
            need(getattr(self, key) in ("dma", "kernel", "auto"), key,
                 "must be 'dma', 'kernel' or 'auto'")
        need(self.integrity_key_file is None or (
            isinstance(self.integrity_key_file, str) and self.integrity_key_file != ""),
            "integrity_key_file", "must be a file path (string) or null")
        need(self.io_depth >= 1, "io_depth", "must be >= 1")
        need(self.io_depth <= 256, "io_depth", "must be <= 256")
        need(self.lookahead >= 0, "lookahead", "must be >= 0")
        need(1 <= self.preload_depth <= 64, "preload_depth", "must be in 1..64")
        need(self.copy_headroom >= 0, "copy_headroom", "must be >= 0")
        need(self.staging_bytes > 0, "staging_bytes", "must be > 0")
        need(self.dram_cache_bytes >= 0, "dram_cache_bytes", "must be >= 0")
        need(self.block_size > 0, "block_size", "must be > 0")
        need(self.max_disk_bytes >= 0, "max_disk_bytes", "must be >= 0 (0 = unbounded)")
        need(self.eviction_policy in ("lru", "arc", "lru-admit"), "eviction_policy",
             "must be 'lru', 'arc' or 'lru-admit'")
        need(self.writeback_max_fraction == "auto" or (
            isinstance(self.writeback_max_fraction, (int, float))
            and not isinstance(self.writeback_max_fraction, bool)
            and 0 < self.writeback_max_fraction <= 1), "writeback_max_fraction",
             "must be 'auto' or a number in (0, 1]")
        need(isinstance(self.preload_keep_s, (int, float)) and not isinstance(
            self.preload_keep_s, bool) and 0 <= self.preload_keep_s <= 3600,
             "preload_keep_s", "must be a number of seconds in 0..3600 (0 = off)")
        need(isinstance(self.writeback_defer_s, (int, float)) and not isinstance(
            self.writeback_defer_s, bool) and 0 <= self.writeback_defer_s <= 10,
             "writeback_defer_s", "must be a number of seconds in 0..10 (0 = off)")
        need(self.write_depth_reading == "auto" or (
            isinstance(self.write_depth_reading, int)
            and not isinstance(self.write_depth_reading, bool)
            and 0 <= self.write_depth_reading <= self.io_depth), "write_depth_reading",
             "must be 'auto' or an integer in 0..io_depth")
        need(self.disk_admission in ("all", "reuse"), "disk_admission",
             "must be 'all' or 'reuse'")
        need(self.direct_io in ("auto", "on", "off"), "direct_io", "must be auto, on or off")
        need(self.publish_method in ("link", "rename", "auto"), "publish_method",
             "must be link, rename or auto")
        need(self.io_async in ("auto", "on", "off"), "io_async", "must be auto, on or off")
        need(self.engine in ("auto", "io_uring", "posix"), "engine",
             "must be auto, io_uring or posix")
        need(isinstance(self.durable, bool), "durable", "must be true or false")
        need(isinstance(self.writeback_flush, bool), "writeback_flush", "must be true or false")
        need(isinstance(self.verify_checksum, bool), "verify_checksum", "must be true or false")
        need(isinstance(self.allow_foreign_root, bool), "allow_foreign_root",
             "must be true or false")
        self.dir_mode = check_mode(self.dir_mode, "dir_mode", 0o700)
        self.file_mode = check_mode(self.file_mode, "file_mode", 0o600)

    def check_pool(self, slot_bytes: int) -> None:
        """Check that the staging pool holds io_depth + copy_headroom slots of ``slot_bytes``."""
        need_slots = self.io_depth + max(1, self.copy_headroom)
        have = self.staging_bytes // slot_bytes
        if have < need_slots:
            raise ConfigError(
                f"py-kvcache config key 'staging_bytes': {self.staging_bytes} bytes hold {have} "
                f"slots of {slot_bytes} bytes, need io_depth + copy_headroom = {need_slots} "
                f"(at least {need_slots * slot_bytes} bytes)")

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_dict(cls, d: dict[str, Any], allowed_extra: tuple[str, ...] = ()) -> StorageConfig:
        """Build from a dict (JSON config / kv_connector_extra_config).

        Keys in ``allowed_extra`` are kept in ``extra`` for the caller (e.g. vLLM's
        ``spec_name``); any other unknown key is an error that names it.
        """
        known = set(cls.keys())
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in d.items():
            if k in known:
                kwargs[k] = v
            elif k in allowed_extra:
                extra[k] = v
            else:
                raise ConfigError(f"py-kvcache: unknown config key '{k}'; valid keys: "
                                  f"{', '.join(sorted(known | set(allowed_extra)))}")
        return cls(extra=extra, **kwargs)

    @classmethod
    def from_json(cls, text: str) -> StorageConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"py-kvcache: config is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError("py-kvcache: config must be a JSON object")
        return cls.from_dict(d)


def write_depth_reading_of(storage: StorageConfig) -> int | None:
    """The reactor's ``write_depth_reading`` for ``storage`` (None: its write depth).
    ``"auto"`` resolves to 0 with a DRAM tier, whose slots hold the blocks waiting for
    their files while loads read, and to None without one, where pending writes would
    hold the bounded staging pool and stores would be dropped instead."""
    wdr = storage.write_depth_reading
    if wdr == "auto":
        return 0 if storage.dram_cache_bytes > 0 else None
    return int(wdr)


def _shown(key: str, value: Any) -> str:
    """How a default appears in the configuration table (README, ``--help``)."""
    if key == "root_dir":
        return "`$XDG_CACHE_HOME/py-kvcache` or `~/.cache/py-kvcache`"
    if key.endswith("_mode"):
        return f"`{value:04o}`"
    if isinstance(value, bool):
        return "true" if value else "false"
    if key.endswith("_bytes") and isinstance(value, int) and value:
        return f"{value // MiB} MiB" if value % MiB == 0 else str(value)
    if value is None:
        return "-"
    if isinstance(value, str):
        return f"`{value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_table() -> list[str]:
    """The Markdown table of every configuration key (storage keys of
    :class:`StorageConfig` with :data:`KEY_HELP`, then the vLLM glue's keys with
    ``GLUE_KEY_HELP``): the README's table is this output (``scripts/gen_config_table.py``;
    ``tests/test_config_table.py`` checks it)."""
    from .vllm.options import GLUE_DEFAULTS, GLUE_KEY_HELP

    rows = ["| key | default | meaning |", "|---|---|---|"]
    defaults = StorageConfig()
    for k in StorageConfig.keys():
        rows.append(f"| `{k}` | {_shown(k, getattr(defaults, k))} | {KEY_HELP[k]} |")
    for k, h in GLUE_KEY_HELP.items():
        rows.append(f"| `{k}` | {GLUE_DEFAULTS.get(k, '-')} | {h} |")
    return rows


TABLE_BEGIN = "<!-- config-table: generated by scripts/gen_config_table.py -->"
TABLE_END = "<!-- config-table end -->"


def readme_with_table(readme: str) -> str:
    """``readme`` with the text between the table markers replaced by
    :func:`config_table` (ValueError when the markers are missing)."""
    a, b = readme.find(TABLE_BEGIN), readme.find(TABLE_END)
    if a < 0 or b < a:
        raise ValueError("README has no config-table markers")
    return (readme[:a + len(TABLE_BEGIN)] + "\n" + "\n".join(config_table()) + "\n"
            + readme[b:])

