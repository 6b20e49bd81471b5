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
