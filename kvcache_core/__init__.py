"""py-kvcache: an external KV cache for vLLM (DRAM + NVMe tiers, io_uring reactor).

Nothing here imports vLLM; the vLLM glue lives in :mod:`kvcache_core.vllm`.
"""

from .config import ConfigError, StorageConfig
from .layout import CorruptBlock, Layout, LayoutError, Namespace
from .reactor import Completion, Reactor
from .staging import Priority, SlotAllocator, StagingPool

__version__ = "0.1.0"

__all__ = ["Completion", "ConfigError", "CorruptBlock", "Layout", "LayoutError", "Namespace",
           "Priority", "Reactor", "SlotAllocator", "StagingPool", "StorageConfig",
           "__version__"]
