"""py-kvcache: an external KV cache for vLLM (DRAM + NVMe tiers, io_uring reactor).

Nothing here imports vLLM; the vLLM glue lives in :mod:`kvcache_core.vllm`.
"""

from typing import TYPE_CHECKING, Any

from .config import ConfigError, StorageConfig
from .layout import CorruptBlock, Layout, LayoutError, Namespace
from .staging import Priority, SlotAllocator, StagingPool

if TYPE_CHECKING:
    from .reactor import Completion, Reactor


def __getattr__(name: str) -> Any:
    # The I/O reactor (worker side) is imported on first use only: vLLM's scheduler side
    # imports this package without it.
    if name in ("Completion", "Reactor"):
        from . import reactor

        return getattr(reactor, name)
    raise AttributeError(f"module 'kvcache_core' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = ["Completion", "ConfigError", "CorruptBlock", "Layout", "LayoutError", "Namespace",
           "Priority", "Reactor", "SlotAllocator", "StagingPool", "StorageConfig",
           "__version__"]
