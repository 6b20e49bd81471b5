"""vLLM general plugin: py-kvcache config errors at process start (issue 13 item 3).

Registered as the ``vllm.general_plugins`` entry point ``py_kvcache``. vLLM calls
:func:`register` early in every process: from ``AsyncEngineArgs.add_cli_args`` (before
``vllm serve`` / the OpenAI API server parses its arguments) and from
``EngineArgs.__post_init__`` (``LLM(...)``), then again in the engine-core and worker
processes. It installs two cheap hooks, each once per process:

* ``KVTransferConfig.__post_init__``: when ``kv_connector_module_path`` is
  ``kvcache_core.vllm``, the ``kv_connector_extra_config`` is validated with
  :func:`~kvcache_core.vllm.options.parse_extra_config` while ``--kv-transfer-config``
  is parsed, so a misspelt key or a bad value is ONE error line naming the key, seconds
  after start instead of after the model load (40-53 s) inside ~240 lines of tracebacks.
  The line is logged (``vllm.pykvcache``) before the error is raised: pydantic wraps it
  and argparse prints its whole usage before its own error message.
* ``EngineArgs.create_engine_config``: the same check for a ``KVTransferConfig`` that was
  built before the plugin was loaded (``LLM(kv_transfer_config=KVTransferConfig(...))``).

Configurations of other connectors are never touched, and nothing here raises into vLLM
except the :class:`~kvcache_core.config.ConfigError` of a py-kvcache config. Once per
process, a valid config with ``preload_lookahead`` > 0 on a vLLM without py-kvcache's
patches logs one warning saying that preload is inactive and how to patch.

On vLLM 0.26.x it also installs :mod:`kvcache_core.vllm.backports` (an upstream fix to
vLLM's own offloading scheduler that the native tiered offload needs under concurrency;
``KVCACHE_VLLM_BACKPORTS=0`` leaves vLLM as released).

Supported vLLM releases: 0.26.x and 0.32.x (:mod:`kvcache_core.vllm.compat`). On any
other vLLM the plugin still registers (it must not break vLLM for other connectors) and
logs one warning per process; a py-kvcache config is then refused when it is parsed
(:class:`~kvcache_core.vllm.compat.UnsupportedVLLMError`, a ``ConfigError``, naming the
supported releases), as vLLM's construction of our connector would refuse it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from typing import Any

MODULE_PATH = "kvcache_core.vllm"
#: attribute set on our wrappers: register() wraps each hook once per process
_MARK = "_pykvcache_wrapped"
#: the first line a marker of the preload patch series adds (0002, scheduler.py)
_PATCH_MARKER = "def _offer_preload_candidates"

log = logging.getLogger("vllm.pykvcache")
_preload_warned = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; never raises."""
    try:
        _install_hooks()
    except Exception as e:  # never break vLLM for a configuration that is not ours
        log.debug("py-kvcache plugin: hooks not installed: %r", e)
    try:
        _warn_if_unsupported()
    except Exception as e:  # pragma: no cover - the version check itself failed
        log.debug("py-kvcache plugin: vLLM version not checked: %r", e)
    try:
        from . import backports

        backports.install()
    except Exception as e:  # never break vLLM for a fix it may not need
        log.warning("py-kvcache plugin: vLLM backports not installed: %r", e)


_unsupported_warned = False


def _warn_if_unsupported() -> None:
    """One warning per process when this vLLM is not a supported release."""
    global _unsupported_warned
    from . import compat

    if compat.VLLM_LINE is None and not _unsupported_warned:
        _unsupported_warned = True
        log.warning("py-kvcache is installed but does not support vLLM %s (supported: %s): "
                    "its connector will refuse to start", compat.VLLM_VERSION,
                    compat.supported_text())


def _install_hooks() -> None:
    from vllm.config.kv_transfer import KVTransferConfig

    from ..config import ConfigError

    post_init = KVTransferConfig.__post_init__
    if not getattr(post_init, _MARK, False):

        @functools.wraps(post_init)
        def __post_init__(self: Any) -> None:
            post_init(self)
            try:
                validate_kv_transfer_config(self)
            except ConfigError as e:
                # pydantic wraps it ("1 validation error for KVTransferConfig / Value
                # error, ...") and argparse prints its whole usage (~260 lines) before
                # it: log it first, as one line, so that it is what the user reads first
                log.error("%s", e)
                raise

        setattr(__post_init__, _MARK, True)
        KVTransferConfig.__post_init__ = __post_init__  # pydantic looks it up by name

    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config
    if not getattr(create, _MARK, False):

        @functools.wraps(create)
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            validate_kv_transfer_config(getattr(self, "kv_transfer_config", None))
            return create(self, *args, **kwargs)

        setattr(create_engine_config, _MARK, True)
        EngineArgs.create_engine_config = create_engine_config


def is_ours(kv_transfer_config: Any) -> bool:
    """A py-kvcache config: our connector module, or our spec behind vLLM's connector
    (the spec would refuse the same extra config later, after the model load)."""
    if getattr(kv_transfer_config, "kv_connector_module_path", None) == MODULE_PATH:
        return True
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    return isinstance(extra, dict) and extra.get("spec_module_path") == MODULE_PATH


def validate_kv_transfer_config(kv_transfer_config: Any) -> None:
    """Validate the extra config of a py-kvcache ``KVTransferConfig`` (others: no-op).

    Raises :class:`~kvcache_core.config.ConfigError` naming the key, or
    :class:`~kvcache_core.vllm.compat.UnsupportedVLLMError` (a ``ConfigError``) naming
    the supported vLLM releases when this vLLM is none of them. Inside
    ``KVTransferConfig``'s validation pydantic reports it as ``Value error, <our
    message>``; vLLM's argument parser prints that as the error of
    ``--kv-transfer-config``.
    """
    if kv_transfer_config is None or not is_ours(kv_transfer_config):
        return
    from . import compat
    from .options import parse_extra_config

    compat.require()  # UnsupportedVLLMError (a ConfigError) on other vLLM releases
    opts = parse_extra_config(getattr(kv_transfer_config, "kv_connector_extra_config", None))
    if opts.preload_lookahead > 0:
        warn_if_unpatched()


def vllm_site_dir() -> str | None:
    """Directory holding the importable ``vllm`` package (the ``--target`` to patch)."""
    mod = sys.modules.get("vllm")
    path = getattr(mod, "__file__", None)
    if path is None:
        spec = importlib.util.find_spec("vllm")
        path = spec.origin if spec is not None else None
    return os.path.dirname(os.path.dirname(path)) if path else None


def vllm_is_patched() -> bool:
    """Whether the importable vLLM carries the preload patches.

    Same test as :func:`kvcache_core.patching.is_patched` (the scheduler's
    ``_offer_preload_candidates``), made without importing the scheduler (~1.4 s) when it
    is not imported yet: its source is read instead.
    """
    sched = sys.modules.get("vllm.v1.core.sched.scheduler")
    if sched is None:
        root = vllm_site_dir()
        if root is not None:
            try:
                with open(os.path.join(root, "vllm", "v1", "core", "sched", "scheduler.py"),
                          encoding="utf-8") as f:
                    return _PATCH_MARKER in f.read()
            except OSError:
                pass
    from ..patching import is_patched

    return is_patched()


def warn_if_unpatched() -> bool:
    """Log ONE warning per process if preload cannot run (vLLM not patched).

    Returns True if the warning was logged by this call.
    """
    global _preload_warned
    if _preload_warned:
        return False
    try:
        patched = vllm_is_patched()
    except Exception as e:  # a failed check must not stop the server
        log.debug("py-kvcache: cannot tell whether vLLM is patched: %r", e)
        return False
    _preload_warned = True
    if patched:
        return False
    target = vllm_site_dir() or "<site-packages or vLLM checkout>"
    log.warning(
        "py-kvcache: preload_lookahead > 0 but this vLLM does not carry py-kvcache's preload "
        "patches, so preload is INACTIVE (disk blocks are read on demand). Fix: "
        "`kvcache patch-vllm --target %s` and restart, or set \"preload_lookahead\": 0 to "
        "silence this warning.", target)
    return True
