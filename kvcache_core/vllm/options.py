"""Parsing and derivation of the vLLM-side settings (no vLLM import here).

Everything that must be computed IDENTICALLY in vLLM's scheduler process and in every
worker process lives here as pure functions of config-level facts: the parsed
``kv_connector_extra_config`` (:func:`parse_extra_config`), the chunk geometry
(:func:`resolve_blocks_per_chunk`), the storage namespace of each rank
(:func:`make_namespace`) and the slot counts of the staging pool and of the DRAM tier
(:func:`pool_geometry`). Worker tensor shapes never enter these computations, so the
scheduler (which has no tensors) and the workers always agree on file names and on the
DRAM slot numbering.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ..config import ConfigError, StorageConfig
from ..layout import Namespace

# A child of vLLM's logger: our lines appear in vLLM's log stream, with its format and
# level (VLLM_LOGGING_LEVEL).
log = logging.getLogger("vllm.pykvcache")
_seed_set_by_us = False

#: Private key the connector subclass injects into the extra config (both roles): the
#: model's torch dtype as a string ("bfloat16"). vLLM's OffloadingConfig only carries the
#: KV-cache dtype string, which is "auto" unless --kv-cache-dtype is given.
MODEL_DTYPE_KEY = "_pykvcache_model_dtype"
#: Private key injected the same way: the fingerprint of everything about the model that
#: changes its KV bytes but not its name (:func:`model_identity`).
MODEL_IDENTITY_KEY = "_pykvcache_model_identity"
#: hf_config fields that do not change the KV (bookkeeping of the file that was read)
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash",
                         "_attn_implementation_autoset")
#: weight files are fingerprinted by name, size and their last bytes (cheap: a fine-tune
#: written over the same files changes them, a copy to another path does not)
WEIGHT_TAIL_BYTES = 1 << 16
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".index.json")

#: Keys that vLLM itself reads from kv_connector_extra_config for an OffloadingSpec
#: (factory.py: spec_name/spec_module_path; offloading/config.py: block_size (also ours)
#: and blocks_per_chunk; kv_offload/base.py: offload_prompt_only, self_describing_kv_events).
VLLM_KEYS: tuple[str, ...] = ("spec_name", "spec_module_path", "blocks_per_chunk",
                              "offload_prompt_only", "self_describing_kv_events")
#: Keys of the vLLM glue itself (not storage-engine keys).
GLUE_KEYS: tuple[str, ...] = ("model_id", "load_failure_policy", "preload_lookahead",
                               "preload_max_blocks", "breakeven_table", "queue_aware_preload",
                               "disk_min_prefix_tokens", "min_store_prefix_tokens",
                               "disk_lookup_cache_s", "disk_lookup_async", "dram_load_sync",
                               "gpu_kv_layout",
                               "preload_protect", "disk_load_hold_s", "disk_load_hold_when",
                               "disk_load_hold_requests", "disk_backlog_gate",
                               "gate_balance", "join_promotions", "disk_warm_start",
                               "preload_protect_requests")
PRIVATE_KEYS: tuple[str, ...] = (MODEL_DTYPE_KEY, MODEL_IDENTITY_KEY)
#: Public names from the design that this version does not implement: refusing them is
#: better than silently running without the feature the operator asked for.
RESERVED_KEYS: dict[str, str] = {}

GLUE_KEY_HELP: dict[str, str] = {
    "spec_name": "vLLM: the OffloadingSpec class, 'PyKVCacheSpec'.",
    "spec_module_path": "vLLM: module of the spec, 'kvcache_core.vllm'.",
    "blocks_per_chunk": "vLLM: GPU blocks per storage block (alternative to block_size; "
    "give one of the two).",
    "offload_prompt_only": "vLLM: store only prompt (prefill) KV, not decode KV "
    "(default true).",
    "self_describing_kv_events": "vLLM: richer BlockStored KV events (default false).",
    "model_id": "Model identity used in the cache namespace instead of vLLM's model name/path "
    "(set it when instances load the same weights from different paths).",
    "load_failure_policy": "'recompute' (default): a missing/corrupt block is recomputed; "
    "'fail': the request fails (vLLM's kv_load_failure_policy is set accordingly).",
    "preload_lookahead": "Waiting requests (first k in scheduling order) whose disk blocks are "
    "preloaded into staging while they queue; needs the patched vLLM (`kvcache patch-vllm`); "
    "0 disables (default 4).",
    "preload_max_blocks": "New blocks planned for preload per scheduler step (default 64); "
    "the reactor runs `preload_depth` speculative reads at a time (default one).",
    "breakeven_table": "Path of a break-even table (`kvcache calibrate`): a reusable prefix "
    "shorter than its source tier's threshold is recomputed instead of loaded; a table whose "
    "disk tier never wins also turns disk writes and preloads off (the DRAM tier still "
    "stores). Missing file or a table of another model: one warning, no gating. Unset: no "
    "gating.",
    "disk_min_prefix_tokens": "A request whose prompt is shorter than this many tokens "
    "writes no files: its chunks stay in the DRAM tier only (or are not stored when the "
    "DRAM tier is off or full), because a disk hit that short would not beat recomputing it. "
    "Keeps short chat turns from paying for disk writes that are never read back. An "
    "integer >= 0, or 'auto' (default): the break-even table's disk threshold "
    "(min_prefix_tokens of its disk tier) when breakeven_table is set, else 0 (every "
    "request writes its files).",
    "min_store_prefix_tokens": "A request whose prompt is shorter than this many tokens "
    "stores nothing (no DRAM-tier slot, no file). The break-even gate recomputes every "
    "reusable prefix shorter than the DRAM tier's threshold, and a later request that "
    "could reuse more than that is itself at least that long and stores every chunk of "
    "its prompt (those it found in the GPU prefix cache included), so such stores are "
    "never loaded; on chat traffic they are most of the stores and their copies slow "
    "decoding. An integer >= 0, or 'auto' (default): the break-even table's DRAM "
    "threshold (min_prefix_tokens of its dram tier) when breakeven_table is set and the "
    "DRAM tier is on, else 0 (every request stores).",
    "disk_lookup_cache_s": "Seconds the scheduler believes a disk lookup that found a "
    "block's files (positive lookup cache, at most 65,536 blocks): later lookups of it "
    "touch no filesystem meanwhile. For distributed filesystems where each lookup is a "
    "network round trip (~0.5-0.7 ms per chunk and rank on GlusterFS/FUSE, ~100x local "
    "ext4). A block evicted meanwhile (by any instance) fails its load and is recomputed, "
    "never a wrong token. A number >= 0 (0: off), or 'auto' (default): 2 when root_dir is "
    "on a FUSE filesystem, else 0.",
    "dram_load_sync": "A prefix whose every block is in the DRAM tier is loaded in the "
    "step that computes the rest of its request (vLLM's synchronous load: the forward "
    "pass waits for the host->device copy on the GPU, not on the CPU) instead of "
    "asynchronously, which parks the request for at least one more engine step: under "
    "concurrent decode a step is tens of ms. Disk hits stay asynchronous. A DRAM block that "
    "fails its check is recomputed (vLLM's load-failure recovery, reported in the same "
    "step). Uses internals of vLLM's offloading scheduler, checked at start-up (a vLLM "
    "without them refuses an explicit true; the default then falls back to asynchronous loads "
    "with a warning). Default true: on the H200 it lowered DRAM-hit TTFT at 4k-16k "
    "(0.68-0.77x) and, in one Bailian-coder replay, mean TTFT under a queue (0.20x).",
    "gpu_kv_layout": "How vLLM lays out the GPU KV cache for this connector: "
    "'cross_layer' (default: what vLLM 0.26 gives any OffloadingConnector, its native CPU "
    "offload included: one tensor in which every layer of a block is contiguous, heads "
    "before tokens (HND)) or 'per_layer' (one tensor per layer in the attention backend's "
    "own order, as vLLM lays it out without a connector). For the H200 A/B of what a short "
    "request pays for the connector alone (docs/results/h200/README.md, twenty-third "
    "session); the block bytes differ, so the two use separate cache namespaces. "
    "'per_layer' copies each block in one piece per layer (more copy descriptors). vLLM "
    "0.26 only.",
    "preload_protect": "With preload_lookahead > 0 and a DRAM tier: every step, the DRAM-tier "
    "blocks of the waiting requests in view (the first preload_lookahead, scheduling order) "
    "become the last to be evicted, the head of the queue's last of all and each request's "
    "prefix after its tail, so that a promotion or a store evicts first a block no queued "
    "request will read; and a promotion or store takes no slot whose victim a queued "
    "request reads before the new block (it reads through staging, or writes its file "
    "only: counter dram_queue_refused; a promotion's block counts as read next by the "
    "next request in view after the one loading it, which reads it anyway: since the "
    "thirty-fifth session). Belady's choice over the part of the future the "
    "scheduler can see. Order only: nothing counts as a reuse (with "
    "eviction_policy 'arc', the order within each of its two lists). Stays on "
    "when the break-even table turns preloads off (then nothing is read ahead). 'auto' "
    "(default since the thirty-third session; false before) = on wherever it can work "
    "(preload_lookahead > 0 and a DRAM tier), silently off elsewhere; true = on, with a "
    "warning where it cannot work; false = off. Aimed at queued requests that share a "
    "DRAM tier too small for all their prefixes. With write_depth_reading=0 and "
    "writeback_max_fraction=0.1 (the defaults now, the latter as 'auto'), preload with it "
    "cut the reusing requests' mean TTFT 1.61x (H200, preload off first) and 1.80x "
    "(H100, preload on first) against the same keys without preload, on the queued mixed "
    "16 x 40k "
    "(docs/results/h200/README.md); not measured alone.",
    "preload_protect_requests": "How many waiting requests (scheduling order) "
    "preload_protect keeps the DRAM-tier blocks of: an integer 0..1024, default 0 = "
    "preload_lookahead (as before). A larger value widens only the protected view (the "
    "patched scheduler then offers that many waiting requests each step); preloads are "
    "still planned for the first preload_lookahead. Aimed at many clients over a few "
    "long documents with disk_load_hold_s: on an H100 (thirty-eighth session, fifty "
    "clients over 8 documents of 40k, about 38 waiting) a document's other readers were "
    "mostly outside the view of 4, the next document's promotion evicted its blocks "
    "before they were served, and 1.9x the distinct bytes were read. Costs one dict "
    "update per chunk of each request in view per step (keys cached per request). "
    "Measured (H100, fortieth session, the same run with the hold): 16 read MORE than "
    "the view of 4 (10k: 14.7 against 13.2 GB, mean TTFT 3.74 against 3.36 s; 40k: 60.9 "
    "against 52.3 GB, 15.8 against 13.7 s); leave it at 0.",
    "join_promotions": "true or false (default false). A request whose prefix another "
    "request is reading from disk into the DRAM tier right now (a promotion) loads now "
    "and copies those blocks from that slot once the read is done, instead of waiting in "
    "vLLM's queue until the read ends (HIT_PENDING; vLLM schedules the requests behind it "
    "meanwhile, and their promotions may evict the block before it is used: the "
    "fifty-client runs on an H100 read a document's blocks a second time so). One disk "
    "read either way; the wait moves from vLLM's queue into the load, and the request "
    "keeps its place. A failed read fails the joined chunks too (the slot's header no "
    "longer names the key): they are recomputed. Counters hits_promoting, "
    "loads_join_promotion. New in the thirty-fifth session, CPU-tested, not yet measured "
    "on a GPU.",
    "disk_load_hold_s": "Seconds (default 30; 0 = off; at most 3600). A waiting request "
    "whose reusable prefix must be read from disk, and that the break-even gate (if any) "
    "lets load, waits while another request's disk load is in flight, for at most this "
    "long from its first wait; it keeps its place in vLLM's queue, and requests behind "
    "it that need no disk read (DRAM-tier hits, misses, prefixes another request is "
    "reading) go ahead. On-demand disk loads then run one request at a time at the "
    "disk's full speed instead of sharing it, and the requests of a document that was "
    "just read into the DRAM tier are served from it before another document's read "
    "evicts it. A request whose disk blocks are all being read for another request "
    "right now does not wait: it joins those reads (held, it would read them again "
    "afterwards). Needs nothing from the patch series. Counters loads_held (requests "
    "that waited), loads_hold_joined (requests that joined reads in flight instead), "
    "loads_hold_expired (waits cut by the limit). On (30) by default since the "
    "forty-first session: on an H100 (thirty-eighth to forty-second sessions, preload on) "
    "py-kvcache with 30 was at or below native tiered FS on every workload measured: "
    "fifty clients over 8 documents 0.88x at 10k, 0.60x at 40k, 0.40x at 64k; the queued "
    "mixed 16 x 40k 0.58x (as with 0: it held one request); the mixed 50 x 64k at "
    "concurrency 8 0.58x (0.56x with 0, which read 11 % more). With 0 the fifty clients "
    "at 40k were 0.83x native tiered FS in the same call (forty-second session: 30 was "
    "1.38x faster and read 55 % of the bytes). Against 0 it costs 1.22x "
    "at 10k with fifty clients (every request fits the GPU at once and without the hold "
    "all reads join), 1.04x on the mixed 50 x 64k, and with preload on the queued mixed "
    "16 x 40k 1.08x the mean TTFT (0 was 0.925x of 30, median of three calls, "
    "0.85-1.04x) and 1.024x for its requests with nothing to reuse (forty-third "
    "session). Set 0 for short documents that all "
    "fit the GPU at once; a server with one request at a time never holds.",
    "disk_load_hold_when": "Which waits disk_load_hold_s (> 0) makes: 'loading' (default) "
    "= whenever another request's disk load is in flight (above); 'no_slot' = only when, "
    "besides, the DRAM tier cannot take the request's disk chunks now (fewer acquirable "
    "slots than chunks, the rest held by loads and stores in flight) and could once those "
    "end (the chunks fit the tier). Without the wait such a request reads most of its "
    "prefix through staging and keeps none of it, and the queued requests of the same "
    "document read it again (thirty-third session, queued mixed 16 x 40k: 1.5x the "
    "distinct bytes read); with it the request promotes its prefix into the tier once the "
    "other document's loads end and the requests behind it join that read. Not yet "
    "measured on a GPU.",
    "disk_warm_start": "true (default) or false. At start-up, a background thread lists "
    "the cache's namespace directories and stats every file once, so that the kernel "
    "holds the directory entries and inodes that the scheduler's lookups ask for (one "
    "access() per block). Without it, after a restart, a reboot or drop_caches each "
    "lookup reads them from the disk on the engine's main thread, behind the KV reads "
    "queued there: on an H100 (thirty-eighth session, 50 x 64k at concurrency 8, every "
    "block on disk, fresh process after drop_caches) the scheduler thread spent 12-15 s "
    "of a 65 s run in file checks, one request's lookup 5.9 s. Changes no answer (the "
    "filesystem stays the authority; other processes publish and evict files); reads "
    "metadata only (about 1 KB per file), at most 4 million files. Not needed, and not "
    "run, with max_disk_bytes: each worker already walks the namespace at start-up to "
    "order its evictions, which warms the same caches. Counters warm_files, "
    "warm_dirs, warm_errors, warm_us. New in the thirty-eighth session; measured on an "
    "H100 (forty-third session, fifty clients over 8 documents of 40k, every block on "
    "disk, fresh process after drop_caches): without it 1.045x the mean TTFT, the same "
    "bytes read (one call).",
    "disk_lookup_async": "Where the scheduler's lookups check that a block's files exist: "
    "'off' = on the engine's main thread (as before; microseconds while the "
    "filesystem's metadata is cached); 'on' = on a background thread, every block not "
    "answered within the last second makes its request wait one step (vLLM's RETRY); "
    "'auto' = on the main thread until one check takes 20 ms or more, then in the "
    "background for the next 5 s (re-armed by every slow check). Experimental, off by "
    "default (not yet measured on a GPU; disk_warm_start covers the restart case). A CI "
    "run of the thirty-seventh session hung with 'on': a vLLM 0.26 scheduler livelock "
    "that deferred lookups can trigger (a loaded request parked behind one that cannot "
    "get GPU blocks), fixed in the thirty-eighth session (counter lookups_yielded). After a "
    "restart or "
    "drop_caches the directory entries of the KV files are read from the disk, behind "
    "the KV reads queued there: on an H100 (thirty-seventh session, fifty clients at "
    "40k) single checks took up to 239 ms and one request's lookup 1.9 s, during which "
    "the engine ran no step. Counter lookups_retry.",
    "disk_load_hold_requests": "How many other requests' disk loads disk_load_hold_s (> 0) "
    "lets run before a request with new disk reads waits (an integer 1..64, default 1: "
    "any disk load in flight makes it wait, one document read at a time). 2 lets two "
    "requests (in practice two documents: the requests of a document being promoted wait "
    "on it anyway) read at once, so the disk's queue stays deep while each document read "
    "keeps its DRAM-tier slots for its waiting readers. The admission model of the "
    "thirty-sixth session (scripts/sim_admission.py, pyk-serial-2) put 2 ahead of 1 on the "
    "fifty-client 40k run; measured on an H100 (thirty-seventh session) 2 lost: 31.2 s "
    "mean TTFT and 121 GB read against 16.3 s / 71 GB with 1 (a document's second reader "
    "through staging counts as another request, so two documents' reads interleave and "
    "evict each other's promotions).",
    "disk_backlog_gate": "With breakeven_table: a reusable prefix part of which must come "
    "from disk is read only while the disk can deliver it before the GPU would have "
    "recomputed it: the bytes of the disk loads already in flight plus its own disk "
    "blocks, over the table's disk_read_gbps, against the table's recompute time of the "
    "tokens from its first disk block on. Otherwise its leading DRAM-tier (or staged) "
    "blocks are loaded if the gate passes them alone and the rest is recomputed. Under a "
    "queue of disk hits on a slow disk the GPU then works beside the disk instead of "
    "requests waiting for reads. Decided when vLLM schedules the request; counters "
    "gate_accepted_backlog / gate_refused_backlog. Default false (not yet measured on a "
    "GPU).",
    "gate_balance": "With breakeven_table: a reusable prefix part of which must come from "
    "disk is read or recomputed, whichever costs the queue less, judged when vLLM "
    "schedules the request: the disk delivers it after the disk loads already in flight "
    "plus its own disk blocks (over the table's disk_read_gbps); a recompute finishes "
    "after the prefill still to compute of the requests already scheduled plus its own "
    "recompute g from its first disk block on (the table's recompute times), and makes "
    "each of the k waiting requests in view behind it (the patched scheduler's first "
    "preload_lookahead) wait g longer: the disk is taken when its time <= prefill left + "
    "(k + 1) x g. Replaces the table's static disk threshold (and disk_backlog_gate, "
    "which is this with an idle GPU and no queue): on an idle node it decides as the "
    "table does. If the disk loses, the leading DRAM-tier (or staged) blocks are still "
    "loaded when the gate passes them alone. Keeps disk writes and preloads on where the "
    "table's disk tier never wins idle. Counters gate_accepted_balance / "
    "gate_refused_balance. Default false: aimed at queued long prompts on a disk that "
    "loses to recompute idle (the H200's queued mixed workload: the table alone 0.73x "
    "native tiered FS, reading with write_depth_reading=0 0.52x). On an H100 (thirty-third "
    "session) its first version, without k, recomputed all 9-11 disk prefixes (vLLM "
    "admits a waiting request only when the GPU is about to be free, so the prefill left "
    "was near 0) and was 1.26-1.30x slower than reading them; with k not yet measured "
    "on a GPU.",
    "queue_aware_preload": "With breakeven_table: also preload a waiting request's disk prefix "
    "that is too short (or on a disk too slow) to win when read on demand, if its expected "
    "queueing time (the table's recompute times of the requests ahead) covers the read "
    "(the table's disk bandwidth). When it is scheduled, the blocks every worker reports "
    "staged count as DRAM-tier blocks for the gate; the rest is recomputed. Keeps disk "
    "writes on where the table's disk tier never wins. Default false (not yet measured to "
    "win on a GPU).",
}

#: defaults of the glue keys as the configuration table shows them (tests/test_config_table.py
#: checks them against :func:`parse_extra_config`)
GLUE_DEFAULTS: dict[str, str] = {
    "spec_name": "-", "spec_module_path": "-", "blocks_per_chunk": "from `block_size`",
    "offload_prompt_only": "true", "self_describing_kv_events": "false",
    "model_id": "model path", "load_failure_policy": "`recompute`", "preload_lookahead": "4",
    "preload_max_blocks": "64", "breakeven_table": "-", "disk_min_prefix_tokens": "`auto`",
    "min_store_prefix_tokens": "`auto`",
    "queue_aware_preload": "false", "disk_lookup_cache_s": "`auto`",
    "disk_lookup_async": "`off`",
    "dram_load_sync": "true", "gpu_kv_layout": "`cross_layer`", "preload_protect": "`auto`",
    "disk_load_hold_s": "30", "disk_load_hold_when": "`loading`",
    "disk_load_hold_requests": "1",
    "disk_backlog_gate": "false", "gate_balance": "false", "join_promotions": "false",
    "disk_warm_start": "true", "preload_protect_requests": "0",
}

#: values of ``disk_load_hold_when``: wait behind any disk load in flight, or only while
#: the DRAM tier has no room for the request's disk chunks
HOLD_WHEN: tuple[str, ...] = ("loading", "no_slot")

DEFAULT_TOKENS_PER_CHUNK = 256
#: values of ``gpu_kv_layout``: vLLM's cross-layer tensor (the default) or one per layer
CROSS_LAYER, PER_LAYER = "cross_layer", "per_layer"
GPU_KV_LAYOUTS: tuple[str, ...] = (CROSS_LAYER, PER_LAYER)


@dataclass(frozen=True)
class VllmOptions:
    """The validated ``kv_connector_extra_config``."""

    storage: StorageConfig
    #: True if the user gave ``block_size`` (else ``StorageConfig.block_size`` is a default)
    explicit_block_size: bool
    blocks_per_chunk: int | None
    offload_prompt_only: bool
    model_id: str | None
    load_failure_policy: str
    model_dtype: str | None
    preload_lookahead: int = 4
    preload_max_blocks: int = 64
    breakeven_table: str | None = None
    queue_aware_preload: bool = False
    #: disk prefixes read only while the disk backlog lets them beat recompute
    disk_backlog_gate: bool = False
    #: each disk prefix to whichever finishes it first, the disk or the GPU's queue
    gate_balance: bool = False
    #: DRAM-tier blocks of the waiting requests in view are evicted last (queue order):
    #: True, False, or "auto" (on wherever preload and a DRAM tier let it work)
    preload_protect: bool | str = "auto"
    #: waiting requests whose DRAM-tier blocks ``preload_protect`` keeps (0: the
    #: ``preload_lookahead``)
    preload_protect_requests: int = 0
    #: int, or "auto" (resolved by the connector from the break-even table)
    disk_min_prefix_tokens: int | str = "auto"
    #: int, or "auto" (resolved by the connector from the break-even table)
    min_store_prefix_tokens: int | str = "auto"
    #: seconds, or "auto" (resolved by the spec from root_dir's filesystem)
    disk_lookup_cache_s: float | str = "auto"
    #: "auto", "on" or "off" (:data:`~kvcache_core.vllm.manager.DISK_LOOKUP_ASYNC`)
    disk_lookup_async: str = "off"
    #: :func:`model_identity` digest injected by the connector (None: not known)
    model_identity: str | None = None
    #: DRAM-tier hits loaded synchronously, in the step that computes their request
    dram_load_sync: bool = True
    #: whether the config set ``dram_load_sync`` (an explicit true is refused by a vLLM
    #: without the scheduler internals; the default falls back to asynchronous loads)
    dram_load_sync_set: bool = False
    #: "cross_layer" (vLLM's layout for an offloading connector) or "per_layer"
    gpu_kv_layout: str = CROSS_LAYER
    #: seconds a disk-loading request waits behind another request's disk load (0: off)
    disk_load_hold_s: float = 30.0
    #: which waits ``disk_load_hold_s`` makes (:data:`HOLD_WHEN`)
    disk_load_hold_when: str = "loading"
    #: other requests' disk loads in flight that make a disk-loading request wait
    disk_load_hold_requests: int = 1
    #: a load of a key being promoted copies from the promotion's slot (no HIT_PENDING)
    join_promotions: bool = False
    #: the cache directory's metadata read on a background thread at start-up
    disk_warm_start: bool = True


def _need(ok: bool, key: str, msg: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"py-kvcache config key '{key}': {msg} (got {value!r})")


def _table_switch(ex: Mapping[str, Any], key: str, table: str | None) -> bool:
    """A true/false key (default false) that needs ``breakeven_table``: its decision uses
    the table's recompute times and disk bandwidth."""
    on = ex.get(key, False)
    _need(isinstance(on, bool), key, "must be true or false", on)
    if on and table is None:
        raise ConfigError(f"py-kvcache config key '{key}': needs 'breakeven_table' (the "
                          "decision uses its recompute times and disk bandwidth)")
    return on


def parse_extra_config(extra: Mapping[str, Any] | None) -> VllmOptions:
    """Validate vLLM's ``kv_connector_extra_config`` for py-kvcache.

    Raises :class:`ConfigError` naming the key for an unknown key (a typo must not
    silently run a default) or an invalid value. Pure function; called by the connector
    subclass before vLLM builds anything, and again by the spec in every process.
    """
    d = dict(extra or {})
    for key, why in RESERVED_KEYS.items():
        if key in d:
            raise ConfigError(f"py-kvcache config key '{key}': not supported: {why}")
    public = (*StorageConfig.keys(), *VLLM_KEYS, *GLUE_KEYS)
    for key in d:
        if key not in public and key not in PRIVATE_KEYS:
            close = difflib.get_close_matches(str(key), public, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"py-kvcache: unknown config key '{key}'{hint}; valid keys: "
                              f"{', '.join(sorted(public))}")
    storage = StorageConfig.from_dict(d, allowed_extra=VLLM_KEYS + GLUE_KEYS + PRIVATE_KEYS)
    ex = storage.extra
    bpc = ex.get("blocks_per_chunk")
    if bpc is not None:
        _need(isinstance(bpc, int) and not isinstance(bpc, bool) and bpc > 0,
              "blocks_per_chunk", "must be a positive integer", bpc)
        if "block_size" in d:
            raise ConfigError("py-kvcache config keys 'block_size' and 'blocks_per_chunk': "
                              "give only one of them")
    opo = ex.get("offload_prompt_only", True)
    _need(isinstance(opo, bool), "offload_prompt_only", "must be true or false", opo)
    sdk = ex.get("self_describing_kv_events", False)
    _need(isinstance(sdk, bool), "self_describing_kv_events", "must be true or false", sdk)
    for key in ("spec_name", "spec_module_path"):
        if key in ex:
            _need(isinstance(ex[key], str) and ex[key] != "", key, "must be a non-empty string",
                  ex[key])
    model_id = ex.get("model_id")
    if model_id is not None:
        _need(isinstance(model_id, str) and model_id.strip() != "", "model_id",
              "must be a non-empty string", model_id)
    policy = ex.get("load_failure_policy", "recompute")
    _need(policy in ("recompute", "fail"), "load_failure_policy",
          "must be 'recompute' or 'fail'", policy)
    pk = ex.get("preload_lookahead", 4)
    _need(isinstance(pk, int) and not isinstance(pk, bool) and 0 <= pk <= 1024,
          "preload_lookahead", "must be an integer in 0..1024", pk)
    pm = ex.get("preload_max_blocks", 64)
    _need(isinstance(pm, int) and not isinstance(pm, bool) and pm > 0,
          "preload_max_blocks", "must be a positive integer", pm)
    bt = ex.get("breakeven_table")
    if bt is not None:
        _need(isinstance(bt, str) and bt != "", "breakeven_table", "must be a file path", bt)
    # switches whose decision uses the table's recompute times and disk bandwidth
    qa, bg, gb = (_table_switch(ex, key, bt) for key in ("queue_aware_preload",
                                                         "disk_backlog_gate",
                                                         "gate_balance"))
    pp = ex.get("preload_protect", "auto")
    _need(isinstance(pp, bool) or pp == "auto", "preload_protect",
          "must be true, false or 'auto'", pp)
    pr = ex.get("preload_protect_requests", 0)
    _need(isinstance(pr, int) and not isinstance(pr, bool) and 0 <= pr <= 1024,
          "preload_protect_requests", "must be an integer in 0..1024", pr)
    dm = ex.get("disk_min_prefix_tokens", "auto")
    _need(dm == "auto" or (isinstance(dm, int) and not isinstance(dm, bool) and dm >= 0),
          "disk_min_prefix_tokens", "must be an integer >= 0 or 'auto'", dm)
    ms = ex.get("min_store_prefix_tokens", "auto")
    _need(ms == "auto" or (isinstance(ms, int) and not isinstance(ms, bool) and ms >= 0),
          "min_store_prefix_tokens", "must be an integer >= 0 or 'auto'", ms)
    lc = ex.get("disk_lookup_cache_s", "auto")
    _need(lc == "auto" or (isinstance(lc, (int, float)) and not isinstance(lc, bool)
                           and 0 <= lc <= 3600),
          "disk_lookup_cache_s", "must be a number of seconds in 0..3600 or 'auto'", lc)
    la = ex.get("disk_lookup_async", "off")
    _need(la in ("auto", "on", "off"), "disk_lookup_async", "must be 'auto', 'on' or 'off'",
          la)
    dls = ex.get("dram_load_sync", True)
    _need(isinstance(dls, bool), "dram_load_sync", "must be true or false", dls)
    hold = ex.get("disk_load_hold_s", 30)
    _need(isinstance(hold, (int, float)) and not isinstance(hold, bool)
          and 0 <= hold <= 3600 and hold == hold,
          "disk_load_hold_s", "must be a number of seconds in 0..3600", hold)
    hw = ex.get("disk_load_hold_when", "loading")
    _need(hw in HOLD_WHEN, "disk_load_hold_when",
          "must be " + " or ".join(repr(x) for x in HOLD_WHEN), hw)
    hr = ex.get("disk_load_hold_requests", 1)
    _need(isinstance(hr, int) and not isinstance(hr, bool) and 1 <= hr <= 64,
          "disk_load_hold_requests", "must be an integer in 1..64", hr)
    jp = ex.get("join_promotions", False)
    _need(isinstance(jp, bool), "join_promotions", "must be true or false", jp)
    dws = ex.get("disk_warm_start", True)
    _need(isinstance(dws, bool), "disk_warm_start", "must be true or false", dws)
    gkl = ex.get("gpu_kv_layout", CROSS_LAYER)
    _need(gkl in GPU_KV_LAYOUTS, "gpu_kv_layout",
          "must be " + " or ".join(repr(x) for x in GPU_KV_LAYOUTS), gkl)
    return VllmOptions(storage=storage, explicit_block_size="block_size" in d,
                       blocks_per_chunk=bpc, offload_prompt_only=opo, model_id=model_id,
                       load_failure_policy=policy, model_dtype=ex.get(MODEL_DTYPE_KEY),
                       preload_lookahead=pk, preload_max_blocks=pm, breakeven_table=bt,
                       queue_aware_preload=qa, disk_backlog_gate=bg, gate_balance=gb,
                       preload_protect=pp, preload_protect_requests=pr,
                       disk_min_prefix_tokens=dm,
                       min_store_prefix_tokens=ms,
                       disk_lookup_cache_s=lc, disk_lookup_async=la,
                       model_identity=ex.get(MODEL_IDENTITY_KEY), dram_load_sync=dls,
                       dram_load_sync_set="dram_load_sync" in ex, gpu_kv_layout=gkl,
                       disk_load_hold_s=float(hold), disk_load_hold_when=hw,
                       disk_load_hold_requests=hr, join_promotions=jp,
                       disk_warm_start=dws)


def check_block_size(opts: VllmOptions, gpu_tokens_per_block: int) -> None:
    """``block_size`` must be a positive multiple of vLLM's GPU block size."""
    if opts.explicit_block_size:
        bs = opts.storage.block_size
        if bs % gpu_tokens_per_block:
            raise ConfigError(
                f"py-kvcache config key 'block_size': {bs} tokens is not a multiple of "
                f"vLLM's GPU block size ({gpu_tokens_per_block} tokens)")


def resolve_blocks_per_chunk(opts: VllmOptions, tokens_per_block: Sequence[int],
                             vllm_blocks_per_chunk: int) -> int:
    """GPU blocks per storage block.

    ``block_size`` / ``blocks_per_chunk`` given: vLLM's own value (already derived from
    them). Neither given: vLLM would use ONE GPU block per file (16 tokens on CUDA: tiny
    files, metadata-bound); py-kvcache uses its default of 256 tokens instead.
    """
    if opts.explicit_block_size or opts.blocks_per_chunk is not None:
        return vllm_blocks_per_chunk
    tpb = max(tokens_per_block) if tokens_per_block else DEFAULT_TOKENS_PER_CHUNK
    return max(1, DEFAULT_TOKENS_PER_CHUNK // tpb)


def ensure_hash_seed() -> str:
    """Make vLLM's block-hash seed stable across processes; return the seed in use.

    vLLM 0.26 seeds its block-hash chain (``NONE_HASH``) from ``os.urandom`` unless
    ``PYTHONHASHSEED`` is set, which silently makes every process compute different keys.
    The scheduler-side spec is built before EngineCore calls ``init_none_hash``, so
    setting the variable here (when unset) is enough. ``random`` is refused.
    """
    global _seed_set_by_us
    seed = os.environ.get("PYTHONHASHSEED")
    if seed == "0" and _seed_set_by_us:
        return seed  # this process already set (and logged) it
    if seed is None:
        _seed_set_by_us = True
        os.environ["PYTHONHASHSEED"] = "0"
        log.info("py-kvcache: PYTHONHASHSEED was unset; set it to 0 so that vLLM's block "
                 "hashes (the cache keys) are stable across processes and restarts")
        return "0"
    if seed == "random":
        raise ConfigError(
            "py-kvcache: PYTHONHASHSEED=random makes vLLM seed its block hashes randomly, so "
            "no other process (or restart) could ever find this instance's cache files. "
            "Unset it (py-kvcache then uses 0) or set a fixed value shared by all instances.")
    log.info("py-kvcache: PYTHONHASHSEED=%s: block hashes are stable; every instance sharing "
             "root_dir must use the same value to share blocks", seed)
    return seed


def _weights_fingerprint(model_dir: str) -> str:
    """Names, sizes and last :data:`WEIGHT_TAIL_BYTES` of the weight files directly in
    ``model_dir`` ('' when it is not a local directory or holds none)."""
    if not os.path.isdir(model_dir):
        return ""
    h = xxhash.xxh3_128()
    n = 0
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(_WEIGHT_SUFFIXES):
            continue
        path = os.path.join(model_dir, name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - WEIGHT_TAIL_BYTES))
                tail = f.read(WEIGHT_TAIL_BYTES)
        except OSError:
            continue
        h.update(f"{name}\0{size}\0".encode())
        h.update(tail)
        n += 1
    return h.hexdigest()[:16] if n else ""


def model_identity(model_config: Any, load_format: str = "") -> tuple[str, dict[str, str]]:
    """Fingerprint of what changes a model's KV bytes besides its name and dtypes (issue 12
    item 3): revision, quantization, hf_overrides, the model config (hf_config, without the
    fields that only record where it was read from), the load format and, for a local
    model directory, its weight files (:func:`_weights_fingerprint`). Returns (16-hex
    digest, the components that went into it, for the start-up log). Pure apart from
    reading the weight files' tails; the connector calls it once per process."""
    def text(v: Any) -> str:
        if v is None:
            return ""
        if callable(v):  # hf_overrides may be a function: its qualified name identifies it
            return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', repr(v))}"
        try:
            return json.dumps(v, sort_keys=True, default=str)
        except (TypeError, ValueError):
            return repr(v)

    hf = getattr(model_config, "hf_config", None)
    cfg: Any = None
    if hf is not None:
        to_dict = getattr(hf, "to_dict", None)
        cfg = to_dict() if callable(to_dict) else dict(getattr(hf, "__dict__", {}))
        cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}
    parts = {
        "revision": text(getattr(model_config, "revision", None)),
        "quantization": text(getattr(model_config, "quantization", None)),
        "hf_overrides": text(getattr(model_config, "hf_overrides", None) or None),
        "config": xxhash.xxh3_128_hexdigest(text(cfg).encode())[:16] if cfg is not None else "",
        "load_format": str(load_format or ""),
        "weights": _weights_fingerprint(str(getattr(model_config, "model", "") or "")),
    }
    digest = xxhash.xxh3_128_hexdigest(json.dumps(parts, sort_keys=True).encode())[:16]
    return digest, parts


def namespace_dtype(model_dtype: str | None, cache_dtype: str) -> str:
    """dtype field of the namespace: model dtype, plus the KV-cache dtype when not 'auto'.

    Without the model dtype the cache-dtype string is used, identically in every process
    (PyKVCacheSpec itself refuses to run without our connector subclass, which injects it).
    """
    cache_dtype = cache_dtype.replace("torch.", "")
    if model_dtype is None:
        return f"kv:{cache_dtype}"
    model_dtype = model_dtype.replace("torch.", "")
    return model_dtype if cache_dtype == "auto" else f"{model_dtype}/kv:{cache_dtype}"


def kv_layout_string(*, tokens_per_block: Sequence[int], blocks_per_chunk: int,
                     worker_kv_bytes_per_block: int, tokens_per_hash: int, tp_size: int,
                     pp_size: int, pcp_size: int, dcp_size: int, device: str | None,
                     kv_cache_layout: str | None = None) -> str:
    """Config-level description of how a chunk's bytes are arranged (namespace field).

    ``kv_cache_layout``: vLLM's KV-cache layout name where the release reports it
    (:func:`kvcache_core.vllm.compat.kv_cache_layout`; None adds nothing, so 0.26
    namespaces are unchanged)."""
    tpb = "/".join(str(t) for t in tokens_per_block)
    kvl = f";kvl={kv_cache_layout}" if kv_cache_layout else ""
    return (f"tpb={tpb};bpc={blocks_per_chunk};wkb={worker_kv_bytes_per_block};"
            f"tph={tokens_per_hash};tp={tp_size};pp={pp_size};pcp={pcp_size};"
            f"dcp={dcp_size};dev={device or '?'}{kvl}")


def make_namespace(*, model: str, dtype: str, tokens_per_chunk: int, block_bytes: int,
                   rank: int, world_size: int, kv_layout: str) -> Namespace:
    """The :class:`Namespace` of one rank (the scheduler computes every rank's)."""
    return Namespace(model=model, dtype=dtype, block_size=tokens_per_chunk,
                     block_bytes=block_bytes, tp_rank=rank, tp_size=world_size,
                     kv_layout=kv_layout)


@dataclass(frozen=True)
class PoolGeometry:
    slot_bytes: int
    n_staging: int
    n_dram: int


def pool_geometry(cfg: StorageConfig, ns: Namespace) -> PoolGeometry:
    """Slot size and slot counts (per worker process).

    ``slot_bytes`` = one file = 4 KiB header + payload rounded to 4 KiB. Staging slots =
    ``staging_bytes // slot_bytes`` (>= io_depth + copy_headroom, else ConfigError);
    DRAM slots = ``dram_cache_bytes // slot_bytes``.
    """
    slot = ns.file_bytes
    cfg.check_pool(slot)
    n_dram = cfg.dram_cache_bytes // slot
    if cfg.dram_cache_bytes and n_dram == 0:
        raise ConfigError(f"py-kvcache config key 'dram_cache_bytes': {cfg.dram_cache_bytes} "
                          f"bytes hold no slot of {slot} bytes (one storage block); use 0 to "
                          f"disable the DRAM tier or at least {slot}")
    return PoolGeometry(slot_bytes=slot, n_staging=cfg.staging_bytes // slot, n_dram=n_dram)
