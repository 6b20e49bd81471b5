"""Item flags shared by the storage engine (``reactor``) and the vLLM glue's two sides.

A tiny core module so that vLLM's scheduler side (``kvcache_core.vllm.manager``) needs
nothing from the worker side's I/O engine: both import the flags from here.
"""

from __future__ import annotations

#: load item: the bytes are already in the (external) slot, skip the disk
IN_SLOT = 1
#: store item: fill the (external) slot only, do not write a file
NO_DISK = 2
#: store item: the block's bytes are already in its (external) slot, written there by an
#: earlier store that wrote no file; write the file from the slot only (a deferred
#: write-back, "flush"). The slot must hold the key (checked) and stay unchanged until
#: the item completes: the caller keeps it pinned meanwhile.
FLUSH = 4
#: load item, with IN_SLOT: the slot is being filled by an earlier load item of the same
#: key (a promotion submitted before this one, still reading): wait until that item is
#: done, then copy from the slot as for a DRAM hit. When that read failed, the slot's
#: header no longer names the key and the header check fails this item (a recompute,
#: never other bytes). Never served without the reactor (the worker's direct DRAM path).
AFTER_LOAD = 8
