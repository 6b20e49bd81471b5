"""LoadStoreSpecs that travel from vLLM's scheduler to the workers (inside the connector
metadata, pickled in multiprocess mode): which keys, and which DRAM-tier slot each uses."""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.kv_offload.base import LoadStoreSpec


class PyKVStoreSpec(LoadStoreSpec):
    """Destination of a store job: chunk ``i`` is ``keys[i]``, copied into DRAM-tier slot
    ``dram_slots[i]`` (then written through to disk), or through a reactor staging slot
    when ``dram_slots[i] == -1``. Keys are in the order of the chunks of the job's
    ``GPULoadStoreSpec`` (group-major, chunk order). ``no_disk``: fill the DRAM-tier slots
    only, write no file (the break-even table says disk loads never pay off here); every
    slot is then >= 0. ``dram_only[i]`` (optional): the same for chunk ``i`` alone (the
    write-back share of the tier is full: the disk is behind); its slot is >= 0."""

    def __init__(self, keys: Sequence[bytes], dram_slots: Sequence[int],
                 no_disk: bool = False, dram_only: Sequence[bool] | None = None) -> None:
        if len(keys) != len(dram_slots):
            raise ValueError("keys and dram_slots differ in length")
        if no_disk and any(s < 0 for s in dram_slots):
            raise ValueError("no_disk stores need a DRAM-tier slot for every chunk")
        if dram_only is not None:
            if len(dram_only) != len(keys):
                raise ValueError("keys and dram_only differ in length")
            if any(d and s < 0 for d, s in zip(dram_only, dram_slots, strict=True)):
                raise ValueError("a dram_only chunk needs a DRAM-tier slot")
        self.keys: list[bytes] = list(keys)
        self.dram_slots: list[int] = list(dram_slots)
        self.no_disk = no_disk
        self.dram_only: list[bool] | None = None if dram_only is None else list(dram_only)

    def writes_file(self, i: int) -> bool:
        """Whether chunk ``i`` is written to disk."""
        return not self.no_disk and not (self.dram_only is not None and self.dram_only[i])

    def __repr__(self) -> str:
        return (f"PyKVStoreSpec(n={len(self.keys)}, dram_slots={self.dram_slots}, "
                f"no_disk={self.no_disk}, dram_only={self.dram_only})")


class PyKVLoadSpec(LoadStoreSpec):
    """Source of a load job: chunk ``i`` is ``keys[i]``. ``flags[i]`` has
    :data:`kvcache_core.reactor.IN_SLOT` when the bytes are already in DRAM-tier slot
    ``dram_slots[i]`` (a DRAM hit); otherwise the file is read into ``dram_slots[i]``
    (promotion) or, when it is -1, into a reactor staging slot."""

    def __init__(self, keys: Sequence[bytes], dram_slots: Sequence[int],
                 flags: Sequence[int]) -> None:
        if not len(keys) == len(dram_slots) == len(flags):
            raise ValueError("keys, dram_slots and flags differ in length")
        self.keys: list[bytes] = list(keys)
        self.dram_slots: list[int] = list(dram_slots)
        self.flags: list[int] = list(flags)

    def __repr__(self) -> str:
        return (f"PyKVLoadSpec(n={len(self.keys)}, dram_slots={self.dram_slots}, "
                f"flags={self.flags})")
