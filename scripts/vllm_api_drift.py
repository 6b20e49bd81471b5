#!/usr/bin/env python3
"""`make api-drift`: which parts of the vLLM API that py-kvcache uses changed between a
vLLM release py-kvcache runs on (BASE) and a newer one (NEW)?

Compares two vLLM source trees (the PyPI sdists, taken from patch_rebase's cache or
downloaded into it; or two already extracted trees) with ``ast``. Nothing of vLLM or of
``kvcache_core.vllm`` is imported. The compared surface:

* every ``from vllm.<mod> import <name>`` in our code (``--ours``, default
  ``kvcache_core/**/*.py``; top level, inside functions, under ``TYPE_CHECKING``; also
  ``import vllm.<mod> as x``). A name is looked up in ``vllm/<mod>.py`` or
  ``vllm/<mod>/__init__.py`` and followed through re-exports (``from .x import Name``);
  a name that is a submodule (``from vllm import _custom_ops as vops``) stands for the
  attributes our file reads from it (``vops.swap_blocks_batch``). A function is compared by
  its signature; a variable by its annotation and value; a class by its members: methods
  (signature, decorators, ``@abstractmethod``), class-level fields and assignments
  (dataclass and NamedTuple fields included, whose constructor is compared as a
  synthesized ``__init__``), and the ``self.X`` attributes assigned in ``__init__``;
* the classes our code SUBCLASSES (a class in ``--ours`` whose base is an imported vLLM
  name) and all their vLLM base classes: every member, plus members ADDED in NEW, new
  abstract methods (and whether we implement them), method bodies that changed, and our
  ``super().X`` references whose target is gone;
* :data:`PRIVATE`, a curated list of private or indirect things our code touches that
  imports do not show (``cs._req_status``, ``RequestGroupState.offload_keys``, ...), each
  with the functions of ours that use it. Keep it current when our code starts to read
  another vLLM internal (grep ``kvcache_core/vllm/`` for ``cs.``, ``self._cs.``, ``cw.``).

"No longer called by vLLM": for each method (or property) of vLLM's class hierarchy that
one of our subclasses overrides (dunders excluded), the call sites in each tree. A call
site is an ``X.<m>(...)`` call (for a property: an ``X.<m>`` read; also
``getattr(X, "<m>")``) in a non-test file of the rule's paths, where

* ``X`` is not ``super()``;
* when ``X`` is ``self``/``cls``: the call is inside a vLLM class our class inherits from
  (elsewhere ``self`` is another class);
* otherwise ``X``'s last name ends with the rule's receiver suffix (if the rule has one)
  and does not start with one of its excluded prefixes, and the call is not inside a class
  of the same hierarchy (a vLLM subclass of one of our class's vLLM bases): those call
  their collaborators or delegate (vLLM's ``OffloadingConnector`` calling its
  ``connector_scheduler``, ``MultiConnector`` its sub-connectors, a tiering manager its
  tiers), which never reaches our override.

The rule is the first of :data:`CALL_RULES` whose class is in our class's vLLM
hierarchy, else :data:`DEFAULT_RULE`:

* ``OffloadingManager`` (PyKVCacheManager): receiver ``...manager`` (``self.manager``,
  ``manager``) in ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/``: the only
  code that drives the offloading connector's manager. Unrelated ``.touch(`` calls
  elsewhere (block pools, CPU-manager policies, tiering tiers, ``Path.touch``) are out;
* ``OffloadingWorker`` (PyKVCacheWorker): receiver ``...worker`` in the same directory;
* ``OffloadingSpec`` (PyKVCacheSpec): any receiver in that directory,
  ``vllm/v1/kv_offload/`` and ``offloading_connector.py``;
* ``KVConnectorWorkerMetadata`` (our worker metadata): receiver ``...meta`` anywhere in
  ``vllm/`` but ``vllm/distributed/ec_transfer/`` (the KV output aggregator);
* ``KVConnectorBase_V1`` (our ``OffloadingConnector``): receivers ``...connector``,
  ``...connector_cls``, ``get_kv_transfer_group()`` anywhere in ``vllm/`` (the scheduler,
  the model runners and the attention layers all call connector hooks), except the
  encoder-cache and aux-output connectors, whose methods have the same names
  (``vllm/distributed/ec_transfer/``, receivers ``ec_*`` / ``aux_*``);
* anything else: any receiver anywhere in ``vllm/``.

Reported: overrides called in BASE and never in NEW, and overrides called in neither
(dead code on both). The rule is textual: a call through an unusual receiver name, or
through a local alias of the bound method, is missed; a same-named method of another
object that passes the rule is counted.

Output: a Markdown report (``--out``, default docs/vllm-api-drift.md; ``--out -`` prints
it instead) and its JSON beside it (every finding, the call sites, the unchanged names).
Sections: changed signatures, removed names, new abstract methods, no longer called,
private attributes gone, bodies changed (names only: the classes we subclass, their
bases and the curated functions), members added to the classes we subclass (and, names
only, to the other classes we use; private ones only where the curated list reads that
class's privates), notes, unchanged names. Private members of the classes we only import
are compared only through the curated list. All file:line are NEW's (BASE's for what is
gone).

Limits: textual/AST comparison only. A changed annotation is a change even when the type
is an alias of the old one; behaviour changes inside a body show only as "body changed"
(docstring-only changes are marked as such), and what a body now does must be read by a
person (docs/vllm-0.34-api.md is such a reading). Names vLLM builds at run time
(module ``__getattr__``, ``setattr``) are noted as "not found in either release".
Members inherited from a non-vLLM base (``torch``, ``pydantic``) are not compared.

Versions: BASE defaults to the newest release line py-kvcache runs on
(``RUNTIME_LINES`` in kvcache_core/patching.py) at its patch-series version, NEW to the
newest release cached or on PyPI. sdists are read from patch_rebase's cache
(``--cache-dir``) or downloaded into it; only the package's .py files (tests left out)
are extracted, into a temporary directory that is removed. Exit 0, also when a download
fails (nothing is written then); 2 for bad arguments (an unknown version, an sdist not
cached with ``--offline``, a tree without ``vllm/``).
"""

# No `from __future__ import annotations`: the tests load this file by path without
# registering it in sys.modules, where dataclasses look string annotations up.
import argparse
import ast
import hashlib
import importlib.util
import json
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_rebase() -> Any:
    """scripts/patch_rebase.py by path (its sdist cache, download and extract helpers)."""
    spec = importlib.util.spec_from_file_location(
        "_api_drift_patch_rebase", os.path.join(REPO, "scripts", "patch_rebase.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rebase = _load_rebase()
version_key = rebase.version_key
CACHE: str = rebase.CACHE
OURS = os.path.join(REPO, "kvcache_core")
OUT = os.path.join(REPO, "docs", "vllm-api-drift.md")

KVC = "vllm/distributed/kv_transfer/kv_connector/v1/"
OFFLOADING = KVC + "offloading/"
SCHED = OFFLOADING + "scheduler.py"
WORKER = OFFLOADING + "worker.py"
COMMON = OFFLOADING + "common.py"
CONNECTOR = KVC + "offloading_connector.py"
KVC_BASE = KVC + "base.py"
OFFLOAD_BASE = "vllm/v1/kv_offload/base.py"
OFFLOAD_CONFIG = "vllm/v1/kv_offload/config.py"
EC_TRANSFER = "vllm/distributed/ec_transfer/"


class Private(NamedTuple):
    """A vLLM name our code reaches without importing it: ``name`` (``Class.attr`` or a
    module-level name) in ``file``; ``used_by``: which of our functions touch it."""

    file: str
    name: str
    used_by: str


#: private/indirect vLLM attributes our code touches (one entry each; ``used_by`` is the
#: one-line note of which of our functions use it, shown in the report)
PRIVATE: tuple[Private, ...] = (
    # vLLM's offloading scheduler (``cs``, SchedulerSide._cs) and its per-request state
    Private(SCHED, "OffloadingConnectorScheduler._req_status",
            "SchedulerSide.touch_request, load_view, store_view, _restore_failed"),
    Private(SCHED, "OffloadingConnectorScheduler._jobs", "SchedulerSide.after_load_job"),
    Private(SCHED, "OffloadingConnectorScheduler._current_batch_load_jobs",
            "SchedulerSide.after_load_job"),
    Private(SCHED, "OffloadingConnectorScheduler._build_store_jobs",
            "SchedulerSide.__init__ (wrapped on 0.26: compat.STORE_JOB_PREFILTER)"),
    Private(SCHED, "OffloadingConnectorScheduler.update_connector_output",
            "SchedulerSide.after_load_job (dram_load_sync completes the job)"),
    Private(SCHED, "OffloadingConnectorScheduler.manager", "SchedulerSide.__init__"),
    Private(SCHED, "OffloadingConnectorScheduler.config", "SchedulerSide.__init__"),
    Private(SCHED, "RequestOffloadState.req", "SchedulerSide.store_view"),
    Private(SCHED, "RequestOffloadState.req_context", "SchedulerSide.touch_request"),
    Private(SCHED, "RequestOffloadState.group_states",
            "SchedulerSide.touch_request, store_view, _restore_failed"),
    Private(SCHED, "RequestOffloadState.num_locally_computed_tokens",
            "SchedulerSide.load_view"),
    Private(SCHED, "RequestGroupState.offload_keys",
            "SchedulerSide.touch_request, _restore_failed"),
    Private(SCHED, "RequestGroupState.next_stored_chunk_idx",
            "SchedulerSide.store_view (reads), _restore_failed (rewinds)"),
    Private(SCHED, "TransferJobStatus.keys", "SchedulerSide.after_load_job (hold_loads)"),
    Private(COMMON, "TransferJob.req_id", "SchedulerSide.after_load_job"),
    Private(SCHED, "SchedulerOffloadConfig.kv_group_configs", "SchedulerSide.__init__"),
    Private(SCHED, "SchedulerOffloadConfig.num_workers", "SchedulerSide.__init__"),
    Private(SCHED, "SchedulerOffloadConfig.offload_prompt_only", "SchedulerSide.__init__"),
    Private(SCHED, "GroupOffloadConfig.group_idx", "PyKVCacheManager._plan_prefix"),
    Private(SCHED, "GroupOffloadConfig.tokens_per_chunk",
            "SchedulerSide.gate_lookup, store_view; PyKVCacheManager.plan_preloads"),
    Private(SCHED, "GroupOffloadConfig.hashes_per_chunk", "PyKVCacheManager._plan_prefix"),
    Private(SCHED, "GroupOffloadConfig.tokens_per_block", "SchedulerSide.load_view"),
    Private(SCHED, "KV_LOAD_TIERS_KEY", "compat.request_disk_allowed"),
    Private(SCHED, "_parse_tier_filter", "compat.request_disk_allowed"),
    # what our connector's hooks reach through super() (vLLM's connector delegates)
    Private(SCHED, "OffloadingConnectorScheduler.get_num_new_matched_tokens",
            "OffloadingConnector.get_num_new_matched_tokens (super())"),
    Private(SCHED, "OffloadingConnectorScheduler.update_state_after_alloc",
            "OffloadingConnector.update_state_after_alloc (super())"),
    Private(SCHED, "OffloadingConnectorScheduler.build_connector_meta",
            "OffloadingConnector.build_connector_meta (super())"),
    Private(SCHED, "OffloadingConnectorScheduler.request_finished",
            "OffloadingConnector.request_finished, request_finished_all_groups (super())"),
    Private(WORKER, "OffloadingConnectorWorker.start_kv_transfers",
            "OffloadingConnector.start_load_kv (super())"),
    Private(WORKER, "OffloadingConnectorWorker.build_connector_worker_meta",
            "OffloadingConnector.build_connector_worker_meta (super())"),
    # vLLM's offloading connector worker (``cw``, WorkerSide._cw)
    Private(WORKER, "OffloadingConnectorWorker.worker", "WorkerSide.worker"),
    Private(WORKER, "OffloadingConnectorWorker._load_jobs", "WorkerSide.after_load_submit"),
    # attributes of the connector classes we subclass
    Private(CONNECTOR, "OffloadingConnector.connector_scheduler",
            "OffloadingConnector.__init__"),
    Private(CONNECTOR, "OffloadingConnector.connector_worker", "OffloadingConnector.__init__"),
    Private(KVC_BASE, "KVConnectorBase_V1._connector_metadata",
            "OffloadingConnector.start_preloads, start_load_kv"),
    Private(OFFLOAD_BASE, "OffloadingSpec.tokens_per_block", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_BASE, "OffloadingSpec.tokens_per_hash", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_BASE, "OffloadingSpec.blocks_per_chunk", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_BASE, "OffloadingSpec.kv_events_config", "PyKVCacheSpec.get_manager"),
    # job specs and KV-cache descriptions the worker reads
    Private(OFFLOAD_BASE, "BlockIDsLoadStoreSpec.block_ids", "KVGeometry.split"),
    Private(OFFLOAD_BASE, "GPULoadStoreSpec.group_sizes", "KVGeometry.split"),
    Private(OFFLOAD_BASE, "GPULoadStoreSpec.block_indices", "KVGeometry.split"),
    Private(OFFLOAD_BASE, "CanonicalKVCacheTensor.tensor", "KVGeometry.__init__"),
    Private(OFFLOAD_BASE, "CanonicalKVCacheTensor.page_size_bytes", "KVGeometry.__init__"),
    Private(OFFLOAD_BASE, "ReqContext.req_id", "PyKVCacheManager (every manager method)"),
    Private(OFFLOAD_BASE, "ReqContext.load_tier_filter", "compat.disk_allowed"),
    # what PyKVCacheSpec reads of OffloadingConfig
    Private(OFFLOAD_CONFIG, "OffloadingConfig.extra_config", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingConfig.worker_kv_bytes_per_block",
            "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingConfig.kv_cache_layout", "compat.kv_cache_layout"),
    Private(OFFLOAD_CONFIG, "OffloadingModelConfig.name", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingModelConfig.dtype", "compat.offload_cache_dtype"),
    Private(OFFLOAD_CONFIG, "OffloadingParallelConfig.tp_size", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingParallelConfig.pp_size", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingParallelConfig.pcp_size", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingParallelConfig.dcp_size", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingParallelConfig.rank", "PyKVCacheSpec.__init__"),
    Private(OFFLOAD_CONFIG, "OffloadingParallelConfig.world_size", "PyKVCacheSpec.__init__"),
    # vLLM engine objects the connector reads
    Private("vllm/v1/kv_cache_interface.py", "KVCacheGroupSpec.kv_cache_spec",
            "connector.prepare_vllm_config"),
    Private("vllm/config/cache.py", "CacheConfig.block_size", "connector.prepare_vllm_config"),
    Private("vllm/config/parallel.py", "ParallelConfig.decode_context_parallel_size",
            "connector.prepare_vllm_config"),
    Private("vllm/config/model.py", "ModelConfig.model",
            "connector._identity_of, connector_scheduler.load_gate"),
    Private("vllm/config/model.py", "ModelConfig.dtype", "connector.prepare_vllm_config"),
    Private("vllm/config/load.py", "LoadConfig.load_format", "connector._identity_of"),
    Private("vllm/v1/request.py", "Request.block_hashes", "PyKVCacheManager.plan_preloads"),
    Private("vllm/v1/request.py", "Request.kv_transfer_params",
            "compat.request_disk_allowed, max_load_tokens"),
)


class CallRule(NamedTuple):
    """Where the call sites of an overridden method of ``base``'s hierarchy are counted."""

    base: str  # vLLM class name in our class's hierarchy
    receiver: tuple[str, ...]  # the receiver's last name must end with one ((): any)
    paths: tuple[str, ...]  # directories (ending in /) or files searched
    skip_paths: tuple[str, ...] = ()  # directories left out
    skip_receivers: tuple[str, ...] = ()  # receivers whose last name starts with one of these


#: first match in our class's vLLM hierarchy wins (see the module docstring)
CALL_RULES: tuple[CallRule, ...] = (
    CallRule("OffloadingManager", ("manager",), (OFFLOADING,)),
    CallRule("OffloadingWorker", ("worker",), (OFFLOADING,)),
    CallRule("OffloadingSpec", (), (OFFLOADING, "vllm/v1/kv_offload/", CONNECTOR)),
    CallRule("KVConnectorWorkerMetadata", ("meta",), ("vllm/",), (EC_TRANSFER,)),
    CallRule("KVConnectorBase_V1", ("connector", "connector_cls", "kv_transfer_group()"),
             ("vllm/",), (EC_TRANSFER,), ("ec_", "aux_")),
)
DEFAULT_RULE = CallRule("*", (), ("vllm/",))

#: report order of a name's origin; "tooling": imported only outside a ``vllm/``
#: directory of our code (benchmarks, the patch tooling), listed last
_PRIO = {"subclass": 0, "base": 1, "curated": 2, "import": 3, "tooling": 4}


def log(msg: str) -> None:
    print(f"[api-drift] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ API model
class Param(NamedTuple):
    name: str
    kind: str  # posonly, pos, vararg, kwonly, varkw
    ann: str
    default: str | None

    def text(self) -> str:
        s = {"vararg": "*", "varkw": "**"}.get(self.kind, "") + self.name
        if self.ann:
            s += f": {self.ann}"
        if self.default is not None:
            s += f" = {self.default}"
        return s


@dataclass
class Api:
    """One vLLM name or class member as found in one tree."""

    kind: str  # class, function, method, property, classmethod, staticmethod, setter,
    #            field, attribute, instance attribute, variable, module, constructor
    sig: str
    file: str
    line: int
    params: tuple[Param, ...] | None = None
    returns: str = ""
    body: str = ""  # hash of the code without docstring ("" for non-callables)
    doc: str = ""  # hash of the docstring
    abstract: bool = False
    decorators: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _text(node: ast.AST | None, limit: int = 0) -> str:
    if node is None:
        return ""
    s = " ".join(ast.unparse(node).split())
    return s if not limit or len(s) <= limit else s[:limit - 1] + "…"


def _hash(s: str) -> str:
    return hashlib.sha1(s.encode()).hexdigest()[:12] if s else ""


def params_of(a: ast.arguments) -> tuple[Param, ...]:
    """The parameters of a def, in order."""
    out: list[Param] = []
    pos = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(pos, defaults, strict=True)):
        kind = "posonly" if i < len(a.posonlyargs) else "pos"
        out.append(Param(arg.arg, kind, _text(arg.annotation), None if d is None else _text(d)))
    if a.vararg:
        out.append(Param(a.vararg.arg, "vararg", _text(a.vararg.annotation), None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(Param(arg.arg, "kwonly", _text(arg.annotation),
                         None if d is None else _text(d)))
    if a.kwarg:
        out.append(Param(a.kwarg.arg, "varkw", _text(a.kwarg.annotation), None))
    return tuple(out)


def format_sig(params: Iterable[Param], returns: str = "") -> str:
    parts: list[str] = []
    star = False
    for p in params:
        if p.kind == "kwonly" and not star:
            parts.append("*")
        star = star or p.kind in ("vararg", "kwonly")
        parts.append(p.text())
    return f"({', '.join(parts)})" + (f" -> {returns}" if returns else "")


_KIND_DECOS = {"property": "property", "cached_property": "property",
               "classmethod": "classmethod", "staticmethod": "staticmethod"}


def func_api(node: ast.FunctionDef | ast.AsyncFunctionDef, rel: str, kind: str) -> Api:
    """A def as an :class:`Api` (its kind refined by its decorators)."""
    decos = [_text(d) for d in node.decorator_list]
    abstract = False
    other: list[str] = []
    for d in decos:
        last = d.split("(")[0].rsplit(".", 1)[-1]
        if last == "abstractmethod":
            abstract = True
        elif last in _KIND_DECOS:
            kind = _KIND_DECOS[last]
        elif last in ("setter", "deleter"):
            kind = last
        elif last not in ("override", "overload", "wraps"):
            other.append(d)
    params = params_of(node.args)
    returns = _text(node.returns)
    body = list(node.body)
    doc = ast.get_docstring(node, clean=True) or ""
    if doc:
        body = body[1:]
    code = ast.dump(ast.Module(body=body, type_ignores=[]))
    sig = format_sig(params, returns)
    if kind == "property":
        sig = f"-> {returns}" if returns else "(property)"
    return Api(kind, sig, rel, node.lineno, params, returns, _hash(code), _hash(doc),
               abstract, tuple(other))


def _field_sig(node: ast.AnnAssign) -> str:
    s = _text(node.annotation)
    return s + (f" = {_text(node.value, 80)}" if node.value is not None else "")


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in _text(d) for d in node.decorator_list) or any(
        _text(b).rsplit(".", 1)[-1] == "NamedTuple" for b in node.bases)


def _fields(node: ast.ClassDef) -> list[Param]:
    """Constructor fields of a dataclass/NamedTuple body (ClassVar and init=False left out)."""
    out = []
    for st in node.body:
        if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
            continue
        ann = _text(st.annotation)
        if "ClassVar" in ann or ann.endswith("KW_ONLY"):
            continue
        default = None
        v = st.value
        if v is not None:
            if isinstance(v, ast.Call) and _text(v.func).rsplit(".", 1)[-1] == "field":
                kw = {k.arg: k.value for k in v.keywords}
                init = kw.get("init")
                if isinstance(init, ast.Constant) and init.value is False:
                    continue
                if "default" in kw:
                    default = _text(kw["default"], 60)
                elif "default_factory" in kw:
                    default = f"<{_text(kw['default_factory'], 40)}()>"
            else:
                default = _text(v, 60)
        out.append(Param(st.target.id, "pos", ann, default))
    return out


# ------------------------------------------------------------------ vLLM trees
class Found(NamedTuple):
    """A name resolved in a tree: a class, function, variable or module."""

    kind: str
    rel: str  # file (relative to the tree root)
    node: ast.AST | None
    name: str

    @property
    def key(self) -> tuple[str, str]:
        return self.rel, self.name


def _top_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those under if/try/with (not in defs)."""
    for st in body:
        yield st
        if isinstance(st, ast.If | ast.While | ast.For | ast.With):
            yield from _top_statements(st.body)
            yield from _top_statements(getattr(st, "orelse", []))
        elif isinstance(st, ast.Try):
            yield from _top_statements(st.body)
            for h in st.handlers:
                yield from _top_statements(h.body)
            yield from _top_statements(st.orelse)
            yield from _top_statements(st.finalbody)


def _skip_test(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in ("tests", "test") for p in parts[:-1]) or parts[-1].startswith("test_")


class Tree:
    """One vLLM source tree (``root/vllm/...``): lookups, class members and hierarchy."""

    def __init__(self, root: str, label: str) -> None:
        self.root, self.label = root, label
        self._ast: dict[str, ast.Module | None] = {}
        self._members: dict[tuple[str, str, int], dict[str, Api]] = {}
        self._anc: dict[tuple[str, str, int], list[Found]] = {}
        self._files: list[str] | None = None

    # files and modules
    def rel_of_module(self, mod: str) -> str | None:
        base = mod.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if os.path.isfile(os.path.join(self.root, rel)):
                return rel
        return None

    @staticmethod
    def module_of(rel: str) -> str:
        mod = rel[:-3].replace("/", ".")
        return mod[:-len(".__init__")] if mod.endswith(".__init__") else mod

    def read(self, rel: str) -> str:
        with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
            return f.read()

    def parse(self, rel: str, cache: bool = True) -> ast.Module | None:
        if rel in self._ast:
            return self._ast[rel]
        try:
            tree: ast.Module | None = ast.parse(self.read(rel), filename=rel)
        except (OSError, SyntaxError, ValueError):
            tree = None
        if cache:
            self._ast[rel] = tree
        return tree

    def files(self, prefixes: Iterable[str], skip: Iterable[str] = ()) -> list[str]:
        """Non-test .py files under the directory prefixes (or equal to the file paths),
        except those under ``skip``."""
        if self._files is None:
            found = []
            top = os.path.join(self.root, "vllm")
            for d, dirs, names in os.walk(top):
                dirs[:] = sorted(x for x in dirs if x != "__pycache__")
                for n in sorted(names):
                    if n.endswith(".py"):
                        rel = os.path.relpath(os.path.join(d, n), self.root).replace(os.sep, "/")
                        if not _skip_test(rel):
                            found.append(rel)
            self._files = found
        pre, out = tuple(prefixes), tuple(skip)
        return [f for f in self._files
                if any(f == p or (p.endswith("/") and f.startswith(p)) for p in pre)
                and not f.startswith(out)]

    # lookups
    def _absolute(self, rel: str, module: str | None, level: int) -> str:
        if not level:
            return module or ""
        pkg = self.module_of(rel)
        if not rel.endswith("__init__.py"):
            pkg = pkg.rpartition(".")[0]
        for _ in range(level - 1):
            pkg = pkg.rpartition(".")[0]
        return f"{pkg}.{module}" if module else pkg

    def find(self, mod: str, name: str, depth: int = 0) -> Found | None:
        """``name`` as ``from <mod> import <name>`` would get it, re-exports followed."""
        if depth > 12:
            return None
        rel = self.rel_of_module(mod)
        tree = self.parse(rel) if rel is not None else None
        if rel is None or tree is None:  # a namespace package, or unparsable
            sub = self.rel_of_module(f"{mod}.{name}")
            return Found("module", sub, None, f"{mod}.{name}") if sub is not None else None
        stmts = list(_top_statements(tree.body))
        for st in stmts:
            if isinstance(st, ast.ClassDef) and st.name == name:
                return Found("class", rel, st, name)
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef) and st.name == name:
                return Found("function", rel, st, name)
        for st in stmts:
            if isinstance(st, ast.ImportFrom):
                for a in st.names:
                    if (a.asname or a.name) == name:
                        src = self._absolute(rel, st.module, st.level)
                        hit = self.find(src, a.name, depth + 1)
                        if hit is not None:
                            return hit
            elif isinstance(st, ast.Import):
                for a in st.names:
                    if a.asname == name:
                        sub = self.rel_of_module(a.name)
                        if sub is not None:
                            return Found("module", sub, None, a.name)
        for st in stmts:
            targets: list[ast.expr] = []
            if isinstance(st, ast.Assign):
                targets = st.targets
            elif isinstance(st, ast.AnnAssign):
                targets = [st.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id == name:
                    return Found("variable", rel, st, name)
        sub = self.rel_of_module(f"{mod}.{name}")
        if sub is not None:
            return Found("module", sub, None, f"{mod}.{name}")
        return None

    def api(self, f: Found) -> Api:
        """A resolved top-level name as an :class:`Api`."""
        node = f.node
        if f.kind == "class":
            assert isinstance(node, ast.ClassDef)
            bases = ", ".join(_text(b) for b in node.bases + node.keywords)
            return Api("class", f"class {f.name}({bases})", f.rel, node.lineno)
        if f.kind == "function":
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            return func_api(node, f.rel, "function")
        if f.kind == "variable":
            if isinstance(node, ast.AnnAssign):
                return Api("variable", _field_sig(node), f.rel, node.lineno)
            assert isinstance(node, ast.Assign)
            return Api("variable", f"= {_text(node.value, 80)}", f.rel, node.lineno)
        return Api("module", "module", f.rel, 1)

    def _resolve_expr(self, rel: str, e: ast.expr) -> Found | None:
        if isinstance(e, ast.Subscript):
            e = e.value
        if isinstance(e, ast.Name):
            return self.find(self.module_of(rel), e.id)
        if isinstance(e, ast.Attribute):
            inner = self._resolve_expr(rel, e.value)
            if inner is not None and inner.kind == "module":
                return self.find(inner.name, e.attr)
        return None

    def ancestors(self, f: Found) -> list[Found]:
        """The vLLM classes ``f`` (a class) inherits from, nearest first, each once."""
        assert isinstance(f.node, ast.ClassDef)
        key = (f.rel, f.name, f.node.lineno)
        if key in self._anc:
            return self._anc[key]
        self._anc[key] = []  # cycles
        out: list[Found] = []
        seen = {f.key}
        for b in f.node.bases:
            hit = self._resolve_expr(f.rel, b)
            if hit is None or hit.kind != "class" or hit.key in seen:
                continue
            seen.add(hit.key)
            out.append(hit)
            for a in self.ancestors(hit):
                if a.key not in seen:
                    seen.add(a.key)
                    out.append(a)
        self._anc[key] = out
        return out

    def members(self, f: Found) -> dict[str, Api]:
        """A class's own members: defs, class-level fields/assignments, nested classes,
        ``self.X`` assigned in ``__init__``, and a dataclass/NamedTuple constructor."""
        node = f.node
        assert isinstance(node, ast.ClassDef)
        key = (f.rel, f.name, node.lineno)
        if key in self._members:
            return self._members[key]
        out: dict[str, Api] = {}
        rel = f.rel
        for st in node.body:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef):
                a = func_api(st, rel, "method")
                name = st.name + (f".{a.kind}" if a.kind in ("setter", "deleter") else "")
                out.setdefault(name, a)
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                out[st.target.id] = Api("field", _field_sig(st), rel, st.lineno)
            elif isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = Api("attribute", f"= {_text(st.value, 80)}", rel, st.lineno)
            elif isinstance(st, ast.ClassDef):
                out[st.name] = Api("class", f"class {st.name}", rel, st.lineno)
        init = next((st for st in node.body if isinstance(st, ast.FunctionDef)
                     and st.name == "__init__"), None)
        if init is not None:
            for n in ast.walk(init):
                targets: list[ast.expr] = []
                ann = ""
                if isinstance(n, ast.Assign):
                    targets = [t for t in n.targets]
                    targets += [e for t in n.targets if isinstance(t, ast.Tuple) for e in t.elts]
                elif isinstance(n, ast.AnnAssign):
                    targets, ann = [n.target], _text(n.annotation)
                for t in targets:
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "self" and t.attr not in out):
                        out[t.attr] = Api("instance attribute", ann, rel, n.lineno)
        if _is_dataclass(node) and "__init__" not in out:
            fields: list[Param] = []
            for anc in reversed(self.ancestors(f)):
                assert isinstance(anc.node, ast.ClassDef)
                if _is_dataclass(anc.node):
                    fields = [p for p in fields if p.name not in {x.name for x in
                                                                  _fields(anc.node)}]
                    fields += _fields(anc.node)
            own = _fields(node)
            fields = [p for p in fields if p.name not in {x.name for x in own}] + own
            params = tuple(fields)
            out["__init__"] = Api("constructor", format_sig(params), rel, node.lineno, params)
        self._members[key] = out
        return out

    def member(self, f: Found, name: str) -> Api | None:
        """``name`` of class ``f`` (own members first, then its vLLM bases')."""
        own = self.members(f)
        if name in own:
            return own[name]
        for anc in self.ancestors(f):
            m = self.members(anc)
            if name in m:
                return m[name]
        return None


# ------------------------------------------------------------------ our code
@dataclass
class Import:
    mod: str
    name: str  # "" for `import vllm.x as y`
    alias: str
    file: str
    line: int
    attrs: set[str] = field(default_factory=set)  # alias.X read in the same file


@dataclass
class OurClass:
    name: str
    file: str
    line: int
    base_mod: str
    base_name: str
    methods: dict[str, tuple[int, bool]] = field(default_factory=dict)  # name -> (line, prop)
    super_refs: dict[str, int] = field(default_factory=dict)  # super().X -> line

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _super_refs(cls: ast.ClassDef) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in ast.walk(cls):
        if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Call)
                and isinstance(n.value.func, ast.Name) and n.value.func.id == "super"):
            out.setdefault(n.attr, n.lineno)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "hasattr") and len(n.args) >= 2
              and isinstance(n.args[0], ast.Call) and isinstance(n.args[0].func, ast.Name)
              and n.args[0].func.id == "super" and isinstance(n.args[1], ast.Constant)
              and isinstance(n.args[1].value, str)):
            out.setdefault(n.args[1].value, n.lineno)
    return out


def scan_ours(ours: str) -> tuple[list[Import], list[OurClass]]:
    """Every vLLM import of ``ours`` (a directory of .py files) and every class there
    whose base is an imported vLLM name. Paths are reported relative to ``ours``'s parent."""
    imports: list[Import] = []
    classes: list[OurClass] = []
    top = os.path.dirname(os.path.abspath(ours))
    for d, dirs, names in os.walk(ours):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for n in sorted(names):
            if not n.endswith(".py"):
                continue
            path = os.path.join(d, n)
            rel = os.path.relpath(path, top).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=rel)
            mine: list[Import] = []
            for node in ast.walk(tree):
                if (isinstance(node, ast.ImportFrom) and not node.level and node.module
                        and (node.module == "vllm" or node.module.startswith("vllm."))):
                    for a in node.names:
                        mine.append(Import(node.module, a.name, a.asname or a.name, rel,
                                           node.lineno))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name == "vllm" or a.name.startswith("vllm."):
                            mine.append(Import(a.name, "", a.asname or a.name.split(".")[0],
                                               rel, node.lineno))
            if not mine:
                continue
            by_alias = {i.alias: i for i in mine}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in by_alias):
                    by_alias[node.value.id].attrs.add(node.attr)
            imports += mine
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef):
                    continue
                for b in node.bases:
                    imp = by_alias.get(b.id) if isinstance(b, ast.Name) else None
                    if imp is None or not imp.name:
                        continue
                    oc = OurClass(node.name, rel, node.lineno, imp.mod, imp.name)
                    for st in node.body:
                        if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef):
                            prop = any(_text(x).rsplit(".", 1)[-1] in ("property",
                                                                        "cached_property")
                                       for x in st.decorator_list)
                            oc.methods.setdefault(st.name, (st.lineno, prop))
                    oc.super_refs = _super_refs(node)
                    classes.append(oc)
    return imports, classes


def our_attrs(ours: str) -> set[str]:
    """Every attribute name that appears as ``<expr>.name`` in the .py files of ``ours``
    (reads, calls and assignments alike; a superset of what we use of vLLM's classes)."""
    out: set[str] = set()
    for d, dirs, names in os.walk(ours):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for n in names:
            if n.endswith(".py"):
                with open(os.path.join(d, n), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                out.update(node.attr for node in ast.walk(tree)
                           if isinstance(node, ast.Attribute))
    return out


# ------------------------------------------------------------------ comparison
def describe_change(a: Api, b: Api) -> tuple[str, bool] | None:
    """What changed from ``a`` (BASE) to ``b`` (NEW), and whether it can break a caller or
    an override (parameters removed, renamed, reordered or newly required; a kind change).
    None when nothing but the location changed."""
    parts: list[str] = []
    bad = False
    if a.kind != b.kind:
        parts.append(f"{a.kind} -> {b.kind}")
        bad = True
    if a.params is not None and b.params is not None:
        text, pbad = _describe_params(a.params, b.params)
        if text:
            parts.append(text)
            bad = bad or pbad
        if a.returns != b.returns:
            parts.append(f"returns `{a.returns or '?'}` -> `{b.returns or '?'}`")
    elif a.sig != b.sig:
        parts.append(f"`{a.sig or '(no annotation)'}` -> `{b.sig or '(no annotation)'}`")
    if a.abstract != b.abstract:
        parts.append("now abstract" if b.abstract else "no longer abstract")
        bad = bad or b.abstract
    if a.decorators != b.decorators:
        parts.append(f"decorators {list(a.decorators)} -> {list(b.decorators)}")
    return ("; ".join(parts), bad) if parts else None


def _describe_params(old: tuple[Param, ...], new: tuple[Param, ...]) -> tuple[str, bool]:
    parts: list[str] = []
    bad = False
    on = {p.name: (i, p) for i, p in enumerate(old)}
    nn = {p.name: (i, p) for i, p in enumerate(new)}
    removed = [p for p in old if p.name not in nn]
    added = [p for p in new if p.name not in on]
    for i, p in enumerate(old):
        if p in removed and i < len(new) and new[i] in added and p.kind in ("pos", "posonly") \
                and new[i].kind == p.kind:
            q = new[i]
            parts.append(f"`{p.text()}` -> `{q.text()}` (position {i})")
            removed.remove(p)
            added.remove(q)
            bad = True
    for p in removed:
        parts.append(f"removed `{p.text()}`")
        bad = True
    for optional in (False, True):
        group = [p for p in added
                 if (p.default is not None or p.kind in ("vararg", "varkw")) == optional]
        if group:
            shown = [p.text() if len(group) <= 3 else p.name for p in group]
            parts.append(f"added {'optional' if optional else 'required'} "
                         + ", ".join(f"`{x}`" for x in shown))
            bad = bad or not optional
    old_pos = [p.name for p in old if p.name in nn and p.kind in ("pos", "posonly")]
    new_pos = [p.name for p in new if p.name in on and p.kind in ("pos", "posonly")]
    if old_pos != new_pos and sorted(old_pos) == sorted(new_pos):
        parts.append(f"reordered ({', '.join(new_pos)})")
        bad = True
    for name, (_, p) in on.items():
        if name not in nn:
            continue
        q = nn[name][1]
        if p.kind != q.kind:
            parts.append(f"`{name}` {p.kind} -> {q.kind}")
            bad = True
        if p.ann != q.ann:
            parts.append(f"`{name}`: `{p.ann or '?'}` -> `{q.ann or '?'}`")
        if p.default != q.default:
            if q.default is None:
                parts.append(f"`{name}` lost its default `{p.default}`")
                bad = True
            elif p.default is None:
                parts.append(f"`{name}` got a default `{q.default}`")
            else:
                parts.append(f"`{name}` default `{p.default}` -> `{q.default}`")
    return "; ".join(parts), bad


@dataclass
class Item:
    """One compared name: a top-level vLLM name (``Class`` / ``func`` / ``CONST``) or,
    for curated entries, ``Class.attr``."""

    mod: str
    name: str
    origin: str  # subclass, base, curated, import, tooling (see _PRIO)
    used_by: list[str] = field(default_factory=list)
    ours: list[OurClass] = field(default_factory=list)  # our subclasses (origin subclass/base)

    def note(self) -> str:
        return ", ".join(dict.fromkeys(self.used_by))


@dataclass
class Report:
    base: str
    new: str
    generated: str
    surface: dict[str, Any] = field(default_factory=dict)
    changed: list[dict[str, Any]] = field(default_factory=list)
    removed: list[dict[str, Any]] = field(default_factory=list)
    new_abstract: list[dict[str, Any]] = field(default_factory=list)
    not_called: list[dict[str, Any]] = field(default_factory=list)
    dead_overrides: list[dict[str, Any]] = field(default_factory=list)
    private_gone: list[dict[str, Any]] = field(default_factory=list)
    bodies_changed: list[dict[str, Any]] = field(default_factory=list)
    added: list[dict[str, Any]] = field(default_factory=list)
    added_other: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rules: dict[str, str] = field(default_factory=dict)


class Comparer:
    """Builds a :class:`Report` from our code and the two trees."""

    def __init__(self, old: Tree, new: Tree, ours: str,
                 private: tuple[Private, ...] = PRIVATE) -> None:
        self.old, self.new, self.ours, self.private = old, new, ours, private
        self.report = Report(old.label, new.label,
                             time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        self._touched: set[str] = set()  # qualified names with a finding
        #: every attribute name our code reads or calls (``x.name``): the members of a
        #: class we only import (not subclass) are compared only for these names (and
        #: ``__init__``); the rest of such a class (e.g. ``VllmConfig``'s hundreds of
        #: members) is not our surface and would only be noise
        self.used_attrs: set[str] = our_attrs(ours)
        #: members added to classes we do not subclass: class key -> row
        self._added_other: dict[tuple[str, str], dict[str, Any]] = {}

    # surface -------------------------------------------------------------
    def items(self, imports: list[Import], classes: list[OurClass]) -> list[Item]:
        """The surface: imports (module imports expanded to the attributes we read),
        subclassed classes and their vLLM bases, the curated list; merged by name."""
        raw: list[Item] = []
        for imp in imports:
            where = f"{imp.file}:{imp.line}"
            origin = "import" if "/vllm/" in f"/{imp.file}" else "tooling"
            target = None
            if imp.name:
                target = self.new.find(imp.mod, imp.name) or self.old.find(imp.mod, imp.name)
                is_mod = target is not None and target.kind == "module"
            else:
                is_mod = True
            if is_mod:
                sub = target.name if target is not None else imp.mod
                attrs = sorted(a for a in imp.attrs if not (a.startswith("__")
                                                             and a != "__version__"))
                for a in attrs:
                    raw.append(Item(sub, a, origin, [f"{where} ({imp.alias}.{a})"]))
                if not attrs:
                    raw.append(Item(imp.mod, imp.name, origin, [where]))
            else:
                raw.append(Item(imp.mod, imp.name, origin, [where]))
        for oc in classes:
            raw.append(Item(oc.base_mod, oc.base_name, "subclass",
                            [f"{oc.name} subclasses ({oc.where})"], [oc]))
            for tree in (self.new, self.old):
                f = tree.find(oc.base_mod, oc.base_name)
                if f is None or f.kind != "class":
                    continue
                for anc in tree.ancestors(f):
                    raw.append(Item(tree.module_of(anc.rel), anc.name, "base",
                                    [f"base of {oc.base_name} ({oc.name})"], [oc]))
        for p in self.private:
            raw.append(Item(Tree.module_of(p.file), p.name, "curated", [p.used_by]))
        merged: dict[tuple[str, str], Item] = {}
        for it in raw:
            key = self._key(it)
            cur = merged.get(key)
            if cur is None:
                merged[key] = it
                continue
            cur.used_by += [u for u in it.used_by if u not in cur.used_by]
            cur.ours += [o for o in it.ours if o not in cur.ours]
            if _PRIO[it.origin] < _PRIO[cur.origin]:
                cur.origin = it.origin
        return sorted(merged.values(), key=lambda i: (_PRIO[i.origin], i.mod, i.name))

    def _key(self, it: Item) -> tuple[str, str]:
        cls = it.name.partition(".")[0]
        for tree in (self.new, self.old):
            f = tree.find(it.mod, cls)
            if f is not None:
                return f.rel, it.name
        return it.mod, it.name

    # comparison ------------------------------------------------------------
    def run(self, imports: list[Import], classes: list[OurClass]) -> Report:
        items = self.items(imports, classes)
        r = self.report
        n_members = 0
        for it in items:
            n_members += self._compare_item(it)
        for oc in classes:
            self._overrides(oc)
        r.surface = {
            "imports": len({(i.mod, i.name) for i in imports}),
            "files": len({i.file for i in imports}),
            "names": len(items),
            "members": n_members,
            "subclasses": [f"{oc.name}({oc.base_name})" for oc in classes],
            "curated": len(self.private),
            "overrides": len(r.calls),
        }
        names = {i.name.partition(".")[0] if i.origin != "curated" else i.name for i in items}
        r.unchanged = sorted(n for n in names if n not in self._touched)
        r.rules = {c.base: _rule_text(c) for c in (*CALL_RULES, DEFAULT_RULE)}
        sub = {self._key(i) for i in items if i.origin in ("subclass", "base")}
        r.added_other = [row for key, row in self._added_other.items()
                         if row["members"] and (key[0], row["name"]) not in sub]
        for rows in (r.changed, r.removed, r.new_abstract, r.private_gone, r.bodies_changed,
                     r.added, r.added_other):
            rows.sort(key=lambda x: (_PRIO[x["origin"]], x["name"]))
        return r

    def _mark(self, qual: str) -> None:
        self._touched.add(qual.partition(".")[0])
        self._touched.add(qual)

    def _compare_item(self, it: Item) -> int:
        r = self.report
        cls, _, attr = it.name.partition(".")
        fo, fn = self.old.find(it.mod, cls), self.new.find(it.mod, cls)
        label = it.name
        if fo is None and fn is None:
            r.notes.append(f"`{it.mod}.{it.name}` ({it.note()}): not found in either "
                           "release (built at run time, or gone before BASE)")
            self._mark(label)
            return 0
        if fn is None:
            assert fo is not None
            row = {"name": label, "kind": fo.kind, "base_where": self.old.api(fo).where,
                   "used_by": it.note(), "origin": it.origin}
            (r.private_gone if it.origin == "curated" else r.removed).append(row)
            self._mark(label)
            return 0
        if fo is None:
            r.notes.append(f"`{it.mod}.{it.name}` ({it.note()}): new in {r.new}, absent "
                           f"in {r.base}")
            self._mark(label)
            return 0
        if fo.rel != fn.rel:
            r.notes.append(f"`{it.name}` moved: {fo.rel} -> {fn.rel} (still importable as "
                           f"`{it.mod}.{cls}`)")
        if attr:  # curated Class.attr
            return self._compare_attr(it, fo, fn, attr)
        a, b = self.old.api(fo), self.new.api(fn)
        self._changed(label, a, b, it)
        if it.origin in ("curated",) and fn.kind == "function":
            self._body(label, a, b, it, overridden=False)
        if fo.kind != "class" or fn.kind != "class":
            return 1
        return 1 + self._compare_class(it, fo, fn)

    def _compare_attr(self, it: Item, fo: Found, fn: Found, attr: str) -> int:
        r = self.report
        if fo.kind != "class" or fn.kind != "class":
            r.notes.append(f"`{it.name}`: `{fo.name}` is not a class")
            return 0
        a, b = self.old.member(fo, attr), self.new.member(fn, attr)
        if a is None and b is None:
            r.notes.append(f"`{it.mod}.{it.name}` ({it.note()}): not found in either release "
                           "(check the curated list)")
            self._mark(it.name)
        elif b is None:
            assert a is not None
            r.private_gone.append({"name": it.name, "kind": a.kind, "base_where": a.where,
                                   "used_by": it.note(), "origin": it.origin})
            self._mark(it.name)
        elif a is None:
            r.notes.append(f"`{it.name}` ({it.note()}): new in {r.new} ({b.where})")
            self._mark(it.name)
        else:
            self._changed(it.name, a, b, it)
            if b.body:
                self._body(it.name, a, b, it, overridden=False)
        self._other_added(fo, fn, it, private=True)
        return 1

    def _other_added(self, fo: Found, fn: Found, it: Item, private: bool) -> None:
        """Note the members ``fn`` has and ``fo`` lacks (a class we do not subclass;
        private ones only for the classes whose private attributes we use)."""
        mo, mn = self.old.members(fo), self.new.members(fn)
        row = self._added_other.setdefault(fn.key, {
            "name": fn.name, "where": self.new.api(fn).where, "members": [],
            "origin": it.origin})
        if _PRIO[it.origin] < _PRIO[row["origin"]]:
            row["origin"] = it.origin
        for name in mn:
            if name in mo or name in row["members"] or self.old.member(fo, name) is not None:
                continue
            if name.startswith("_") and not name.startswith("__") and not private:
                continue
            row["members"].append(name)

    def _changed(self, label: str, a: Api, b: Api, it: Item, note: str = "") -> None:
        d = describe_change(a, b)
        if d is None:
            return
        text, bad = d
        self.report.changed.append({
            "name": label, "change": text, "incompatible": bad,
            "base": _short(a.sig, 600), "new": _short(b.sig, 600),
            "where": b.where, "used_by": note or it.note(), "origin": it.origin})
        self._mark(label)

    def _body(self, label: str, a: Api, b: Api, it: Item, overridden: bool) -> None:
        if a.body == b.body and a.doc == b.doc:
            return
        what = "code" if a.body != b.body else "docstring only"
        self.report.bodies_changed.append({
            "name": label, "what": what, "where": b.where, "overridden": overridden,
            "used_by": it.note(), "origin": it.origin})
        if what == "code":
            self._mark(label)

    def _compare_class(self, it: Item, fo: Found, fn: Found) -> int:
        r = self.report
        mo, mn = self.old.members(fo), self.new.members(fn)
        sub = it.origin in ("subclass", "base")
        ours = it.ours
        n = 0
        if not sub:
            self._other_added(fo, fn, it, private=False)
        for name in sorted(set(mo) | set(mn), key=lambda k: (mn.get(k) or mo[k]).line):
            if not sub and name.startswith("_") and not name.startswith("__"):
                continue  # private members of a class we only use: the curated list
            if not sub and name.split(".")[0] not in self.used_attrs and name != "__init__":
                continue  # a member our code never names
            label = f"{fn.name}.{name}"
            a, b = mo.get(name), mn.get(name)
            over = [oc for oc in ours if name.split(".")[0] in oc.methods]
            note = it.note()
            if over:
                note = "; ".join(f"overridden by {oc.name} ({oc.file}:"
                                 f"{oc.methods[name.split('.')[0]][0]})" for oc in over)
            if b is None:
                b = self.new.member(fn, name)  # moved to a vLLM base class?
            if a is None:
                a = self.old.member(fo, name)
            n += 1
            if a is not None and b is None:
                r.removed.append({"name": label, "kind": a.kind, "base_where": a.where,
                                  "used_by": note, "origin": it.origin})
                self._mark(label)
                continue
            if a is None and b is not None:
                if sub:
                    r.added.append({"name": label, "kind": b.kind, "sig": b.sig,
                                    "where": b.where, "used_by": note, "origin": it.origin,
                                    "abstract": b.abstract})
                    if b.abstract:
                        self._abstract(label, b, ours, it)
                continue
            assert a is not None and b is not None
            self._changed(label, a, b, it, note)
            if sub and b.abstract and not a.abstract:
                self._abstract(label, b, ours, it)
            if sub and b.body:
                self._body(label, a, b, it, overridden=bool(over))
        return n

    def _abstract(self, label: str, b: Api, ours: list[OurClass], it: Item) -> None:
        name = label.rpartition(".")[2]
        impl = [oc.name for oc in ours if name in oc.methods]
        self.report.new_abstract.append({
            "name": label, "sig": b.sig, "where": b.where,
            "implemented_by": impl, "used_by": it.note(), "origin": it.origin})
        self._mark(label)

    # overrides and call sites ----------------------------------------------
    def _overrides(self, oc: OurClass) -> None:
        r = self.report
        hier: dict[str, tuple[Found | None, list[Found], dict[str, Api]]] = {}
        for tag, tree in (("old", self.old), ("new", self.new)):
            f = tree.find(oc.base_mod, oc.base_name)
            if f is None or f.kind != "class":
                hier[tag] = (None, [], {})
                continue
            chain = [f, *tree.ancestors(f)]
            mem: dict[str, Api] = {}
            for c in chain:
                for k, v in tree.members(c).items():
                    mem.setdefault(k, v)
            hier[tag] = (f, chain, mem)
        for ref, line in sorted(oc.super_refs.items()):
            if ref.startswith("__") or ref in hier["new"][2]:
                continue
            in_old = ref in hier["old"][2]
            r.removed.append({
                "name": f"super().{ref}", "kind": "super() target",
                "base_where": hier["old"][2][ref].where if in_old else "-",
                "used_by": f"{oc.name} ({oc.file}:{line})"
                           + ("" if in_old else f"; absent in {r.base} too"),
                "origin": "subclass"})
        methods = sorted(m for m in oc.methods if not m.startswith("__")
                         and (m in hier["old"][2] or m in hier["new"][2]))
        counts: dict[str, dict[str, list[str]]] = {}
        rule_used = DEFAULT_RULE
        for tag, tree in (("old", self.old), ("new", self.new)):
            f, chain, mem = hier[tag]
            names = {c.name for c in chain}
            rule = next((c for c in CALL_RULES if c.base in names), DEFAULT_RULE)
            if tag == "new" or f is not None and rule is not DEFAULT_RULE:
                rule_used = rule
            props = {m for m in methods if oc.methods[m][1]
                     or (m in mem and mem[m].kind == "property")}
            sites = (call_sites(tree, set(methods), props, rule, {c.key for c in chain})
                     if f is not None else {})
            log(f"{tree.label}: {oc.name}: {sum(len(v) for v in sites.values())} call sites "
                f"of {len(methods)} overridden methods ({_rule_text(rule)})")
            for m in methods:
                counts.setdefault(m, {})[tag] = sites.get(m, [])
        for m in methods:
            old_sites, new_sites = counts[m].get("old", []), counts[m].get("new", [])
            api = hier["new"][2].get(m) or hier["old"][2].get(m)
            row = {"name": f"{oc.name}.{m}", "ours": f"{oc.file}:{oc.methods[m][0]}",
                   "vllm": api.where if api else "-",
                   "defined_in_base": m in hier["old"][2], "defined_in_new": m in hier["new"][2],
                   "calls_base": len(old_sites), "calls_new": len(new_sites),
                   "sites_base": old_sites[:20], "sites_new": new_sites[:20],
                   "rule": _rule_text(rule_used)}
            r.calls.append(row)
            if old_sites and not new_sites:
                r.not_called.append(row)
                self._mark(f"{oc.base_name}.{m}")
            elif not old_sites and not new_sites:
                r.dead_overrides.append(row)


def _rule_text(rule: CallRule) -> str:
    recv = (" / ".join(f"`*{r}.<m>(`" for r in rule.receiver) if rule.receiver
            else "`<any>.<m>(`")
    text = f"{recv} in {', '.join(rule.paths)}"
    if rule.skip_paths:
        text += f" minus {', '.join(rule.skip_paths)}"
    if rule.skip_receivers:
        text += f", receivers not {'/'.join(p + '*' for p in rule.skip_receivers)}"
    return text


def _last_name(e: ast.expr) -> str:
    if isinstance(e, ast.Attribute):
        return e.attr
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Subscript):
        return _last_name(e.value)
    if isinstance(e, ast.Call):
        return _last_name(e.func) + "()"
    return ""


class _CallFinder(ast.NodeVisitor):
    """Call sites of ``methods`` in one file (see the module docstring for the rule)."""

    def __init__(self, tree: Tree, rel: str, methods: set[str], props: set[str],
                 rule: CallRule, hierarchy: set[tuple[str, str]],
                 family: dict[tuple[str, str, int], bool]) -> None:
        self.tree, self.rel = tree, rel
        self.methods, self.props, self.rule = methods, props, rule
        self.hierarchy, self.family = hierarchy, family
        self.classes: list[ast.ClassDef] = []
        self.funcs: list[str] = []
        self.sites: dict[str, list[str]] = {}

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.generic_visit(node)
        self.classes.pop()

    def _visit_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.funcs.append(node.name)
        self.generic_visit(node)
        self.funcs.pop()

    visit_FunctionDef = _visit_def
    visit_AsyncFunctionDef = _visit_def

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in self.methods and f.attr not in self.props:
            self._consider(f.attr, f.value, node.lineno)
        elif (isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in self.methods):
            self._consider(str(node.args[1].value), node.args[0], node.lineno)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.props and isinstance(node.ctx, ast.Load):
            self._consider(node.attr, node.value, node.lineno)
        self.generic_visit(node)

    def _in_family(self, cls: ast.ClassDef) -> bool:
        key = (self.rel, cls.name, cls.lineno)
        if key not in self.family:
            f = Found("class", self.rel, cls, cls.name)
            keys = {f.key} | {a.key for a in self.tree.ancestors(f)}
            self.family[key] = bool(keys & self.hierarchy)
        return self.family[key]

    def _consider(self, method: str, recv: ast.expr, line: int) -> None:
        if (isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name)
                and recv.func.id == "super"):
            return
        cls = self.classes[-1] if self.classes else None
        if isinstance(recv, ast.Name) and recv.id in ("self", "cls"):
            if cls is None or (self.rel, cls.name) not in self.hierarchy:
                return
        else:
            last = _last_name(recv).lstrip("_")
            if self.rule.receiver and not last.endswith(self.rule.receiver):
                return
            if last.startswith(self.rule.skip_receivers):
                return
            if cls is not None and self._in_family(cls):
                return  # a class of the same interface calling a collaborator
        self.sites.setdefault(method, []).append(f"{self.rel}:{line}")


def call_sites(tree: Tree, methods: set[str], props: set[str], rule: CallRule,
               hierarchy: set[tuple[str, str]]) -> dict[str, list[str]]:
    """Call sites (``file:line``) per method under ``rule`` in ``tree``; ``hierarchy``:
    the (file, class) keys of the vLLM classes our class inherits from."""
    out: dict[str, list[str]] = {}
    if not methods:
        return out
    family: dict[tuple[str, str, int], bool] = {}
    for rel in tree.files(rule.paths, rule.skip_paths):
        text = tree.read(rel)
        if not any(f".{m}" in text or f'"{m}"' in text for m in methods):
            continue
        try:
            mod = ast.parse(text, filename=rel)
        except (SyntaxError, ValueError):
            continue
        finder = _CallFinder(tree, rel, methods, props, rule, hierarchy, family)
        finder.visit(mod)
        for m, s in finder.sites.items():
            out.setdefault(m, []).extend(s)
    return out


# ------------------------------------------------------------------ Markdown
def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return ["None."]
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _short(s: str, limit: int) -> str:
    return s if len(s) <= limit else s[:limit - 1] + "…"


def _code(s: str, limit: int = 160) -> str:
    return f"`{_short(s, limit)}`" if s else ""


def _change(c: dict[str, Any]) -> str:
    text = _short(c["change"], 400)
    return f"**{text}**" if c["incompatible"] else text


def _sites(sites: list[str], total: int) -> str:
    shown = ", ".join(s for s in sites[:4])
    return shown + (f" (+{total - 4})" if total > 4 else "")


def render_md(r: Report) -> str:
    """The Markdown report."""
    s = r.surface
    n_bad = sum(1 for c in r.changed if c["incompatible"])
    lines = [
        f"# vLLM API drift: {r.base} -> {r.new}", "",
        f"Generated {r.generated} by `make api-drift` (`scripts/vllm_api_drift.py "
        f"--base {r.base} --new {r.new}`). Surface: {s.get('imports', 0)} vLLM imports in "
        f"{s.get('files', 0)} files of ours, {s.get('names', 0)} vLLM names ("
        f"{s.get('members', 0)} class members compared), {len(s.get('subclasses', []))} "
        f"subclassed classes ({', '.join(s.get('subclasses', []))}), {s.get('curated', 0)} "
        f"curated private attributes, {s.get('overrides', 0)} overridden methods.", "",
        "Compared with `ast` on the PyPI sdists: signatures, fields and attributes, not "
        "behaviour. A body change is only named (\"Bodies changed\"); read it. file:line "
        f"are {r.new}'s ({r.base}'s for what is gone). **Bold** changes can break a caller "
        "or an override (parameters removed, renamed, reordered or newly required). The "
        "JSON beside this file has every row, the call sites and the unchanged names.", "",
        f"Summary: {len(r.changed)} changed ({n_bad} incompatible), {len(r.removed)} "
        f"removed, {len(r.new_abstract)} new abstract, {len(r.not_called)} no longer "
        f"called, {len(r.dead_overrides)} overrides called in neither, "
        f"{len(r.private_gone)} private attributes gone, {len(r.bodies_changed)} bodies "
        f"changed, {len(r.added)} members added to classes we subclass.", "",
        "## Changed signatures", ""]
    lines += _table(["name", "change", f"{r.new}", "vLLM", "used by"], [
        [f"`{c['name']}`", _change(c), _code(c["new"]), c["where"], c["used_by"]]
        for c in r.changed])
    lines += ["", "## Removed", ""]
    lines += _table(["name", "kind", f"was ({r.base})", "used by"], [
        [f"`{c['name']}`", c["kind"], c["base_where"], c["used_by"]] for c in r.removed])
    lines += ["", "## New abstract methods", ""]
    lines += _table(["name", "signature", "vLLM", "implemented by us"], [
        [f"`{c['name']}`", _code(c["sig"]), c["where"],
         ", ".join(c["implemented_by"]) or "**no**"] for c in r.new_abstract])
    lines += ["", "## No longer called by vLLM", "",
              f"Methods our subclasses override that {r.base} calls and {r.new} never "
              "calls (call-site rule per class in the module docstring of the script).", ""]
    lines += _table(["override", "ours", f"calls {r.base}", f"calls {r.new}",
                     f"{r.base} call sites", "rule"], [
        [f"`{c['name']}`", c["ours"], c["calls_base"], c["calls_new"],
         _sites(c["sites_base"], c["calls_base"]), c["rule"]] for c in r.not_called])
    lines += ["", f"Overrides called in neither {r.base} nor {r.new} (dead code, or "
              "called only through a path the rule does not see):", ""]
    lines += _table(["override", "ours", "vLLM", f"vLLM defines it in {r.base}",
                     f"vLLM defines it in {r.new}"], [
        [f"`{c['name']}`", c["ours"], c["vllm"], "yes" if c["defined_in_base"] else "no",
         "yes" if c["defined_in_new"] else "no"] for c in r.dead_overrides])
    lines += ["", "## Private attributes gone", "",
              "Entries of the curated list (`PRIVATE` in the script) present in "
              f"{r.base} and absent from {r.new}.", ""]
    lines += _table(["name", "kind", f"was ({r.base})", "used by"], [
        [f"`{c['name']}`", c["kind"], c["base_where"], c["used_by"]] for c in r.private_gone])
    lines += ["", "## Bodies changed", "",
              "Methods of the classes we subclass (and their vLLM bases) and curated "
              "functions whose code or docstring differs. Names only: read the diff.", ""]
    lines += _table(["name", "what", "vLLM", "we override", "used by"], [
        [f"`{c['name']}`", c["what"], c["where"], "yes" if c["overridden"] else "",
         c["used_by"]] for c in r.bodies_changed])
    lines += ["", "## Added to classes we subclass", ""]
    lines += _table(["name", "kind", "signature", "vLLM", "used by"], [
        [f"`{c['name']}`", c["kind"] + (" (abstract)" if c["abstract"] else ""),
         _code(c["sig"]), c["where"], c["used_by"]] for c in r.added])
    lines += ["", "## Added to other classes we use", "",
              "Public members new in the classes we import, and all members new in the "
              "classes whose private attributes we use (curated list). Names only.", ""]
    lines += _table(["class", "vLLM", "added"], [
        [f"`{c['name']}`", c["where"], _short(", ".join(f"`{m}`" for m in c["members"]), 600)]
        for c in r.added_other])
    lines += ["", "## Notes", ""]
    lines += [f"* {n}" for n in r.notes] or ["None."]
    lines += ["", "Call-site rules (first class of our class's vLLM hierarchy that has one):",
              ""]
    lines += [f"* {k}: {v}" for k, v in r.rules.items()]
    lines += ["", f"Unchanged ({len(r.unchanged)}): "
              + ", ".join(f"`{n}`" for n in r.unchanged) + ".", "",
              "<details><summary>Every override and its call sites</summary>", ""]
    lines += _table(["override", f"calls {r.base}", f"calls {r.new}", f"{r.new} call sites"], [
        [f"`{c['name']}`", c["calls_base"], c["calls_new"],
         _sites(c["sites_new"], c["calls_new"])] for c in r.calls])
    lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ sdists and main
def default_base() -> str:
    """The patch-series version of the newest release line py-kvcache runs on."""
    p = rebase._patching
    line = max(p.RUNTIME_LINES, key=lambda v: version_key(f"{v}.0"))
    series = [v for v in p.supported_versions() if p.release_line(v) == line]
    return max(series, key=version_key) if series else f"{line}.0"


def py_members(tarball: str) -> set[str]:
    """The package's non-test .py files in an sdist (``vllm/...``, top directory cut)."""
    out = set()
    with tarfile.open(tarball, mode="r:gz") as tf:
        for m in tf:
            parts = m.name.split("/", 1)
            if (len(parts) == 2 and parts[1].startswith("vllm/") and parts[1].endswith(".py")
                    and m.isfile() and not _skip_test(parts[1])):
                out.add(parts[1])
    return out


def tree_root(path: str) -> str | None:
    """The directory holding ``vllm/`` for ``path`` (itself, or its parent when ``path``
    is the ``vllm`` package), None if neither."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "vllm", "__init__.py")):
        return path
    if os.path.basename(path) == "vllm" and os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.dirname(path)
    return None


def write(report: Report, out: str) -> None:
    """``out`` (.md) and its .json; ``-`` prints the Markdown instead."""
    md = render_md(report)
    if out == "-":
        sys.stdout.write(md)
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(md)
    path_json = os.path.splitext(out)[0] + ".json"
    with open(path_json, "w") as f:
        json.dump(asdict(report), f, indent=1)
        f.write("\n")
    log(f"wrote {out} and {path_json}")


def compare(base: Tree, new: Tree, ours: str, private: tuple[Private, ...] = PRIVATE
            ) -> Report:
    """The report for our code in ``ours`` between the two trees (``private``: the
    curated list)."""
    imports, classes = scan_ours(ours)
    log(f"our code: {len(imports)} vLLM imports, subclasses "
        + ", ".join(f"{c.name}({c.base_name})" for c in classes))
    return Comparer(base, new, ours, private).run(imports, classes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the release py-kvcache supports (default: the newest "
                    f"line of RUNTIME_LINES at its patch-series version, {default_base()})")
    ap.add_argument("--new", help="the newer release to compare it with (default: the "
                    "newest release cached, or on PyPI unless --offline)")
    ap.add_argument("--base-tree", metavar="DIR", help="an extracted vLLM tree (DIR/vllm/ or "
                    "the vllm package dir) to use as BASE instead of an sdist; --base then "
                    "only names it")
    ap.add_argument("--new-tree", metavar="DIR", help="the same for NEW")
    ap.add_argument("--ours", default=OURS, metavar="DIR",
                    help="our code, scanned for vLLM imports and subclasses (default "
                    "kvcache_core)")
    ap.add_argument("--out", default=OUT, help="Markdown report; the .json is written "
                    "beside it; '-' prints the Markdown to stdout and writes nothing "
                    "(default docs/vllm-api-drift.md)")
    ap.add_argument("--cache-dir", default=CACHE,
                    help=f"sdist cache shared with patch_rebase.py (default {CACHE})")
    ap.add_argument("--offline", action="store_true",
                    help="use cached sdists only (no PyPI listing or download)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.ours):
        log(f"--ours {args.ours}: not a directory")
        return 2
    roots: dict[str, str | None] = {"base": None, "new": None}
    for tag in ("base", "new"):
        d = getattr(args, f"{tag}_tree")
        if d is not None:
            roots[tag] = tree_root(d)
            if roots[tag] is None:
                log(f"--{tag}-tree {d}: no vllm/ package there")
                return 2
    versions: dict[str, str] = {
        "base": args.base or ("BASE" if roots["base"] else default_base()),
        "new": args.new or ("NEW" if roots["new"] else "")}
    urls: dict[str, str] = {}
    need = [t for t in ("base", "new") if roots[t] is None]
    if need:
        known = rebase.cached_releases(args.cache_dir)
        if not args.offline:
            try:
                listed, urls = rebase.list_releases()
                known = sorted(set(known) | set(listed), key=version_key)
            except Exception as e:  # network, mirror, JSON shape
                log(f"cannot list vLLM releases ({e}); using the cached sdists")
        if not versions["new"]:
            if not known:
                log("no vLLM release cached or listed: give --new (and --offline off)")
                return 2
            versions["new"] = known[-1]
        for t in need:
            v = versions[t]
            if v not in known:
                log(f"--{t} {v}: unknown vLLM release"
                    + (" (not cached; --offline)" if args.offline else ""))
                return 2
    if (roots["base"] is None and roots["new"] is None
            and version_key(versions["base"]) >= version_key(versions["new"])):
        log(f"note: BASE {versions['base']} is not older than NEW {versions['new']}")
    with tempfile.TemporaryDirectory(prefix="api-drift-") as tmp:
        for t in need:
            v = versions[t]
            try:
                tarball = rebase.sdist(v, urls, args.cache_dir)
            except Exception as e:  # offline, 404, disk
                log(f"vLLM {v}: no sdist ({e}); nothing written")
                return 0
            dest = os.path.join(tmp, f"vllm-{v}-{t}")
            os.makedirs(dest)
            log(f"extracting vllm-{v} ...")
            try:
                rebase.extract(tarball, py_members(tarball), dest)
            except (OSError, tarfile.TarError) as e:
                log(f"vLLM {v}: unreadable sdist {tarball} ({e}); nothing written")
                return 0
            roots[t] = dest
        base_root, new_root = roots["base"], roots["new"]
        assert base_root is not None and new_root is not None
        log(f"comparing {versions['base']} -> {versions['new']} ...")
        report = compare(Tree(base_root, versions["base"]), Tree(new_root, versions["new"]),
                         args.ours)
    write(report, args.out)
    log(f"{len(report.changed)} changed, {len(report.removed)} removed, "
        f"{len(report.new_abstract)} new abstract, {len(report.not_called)} no longer "
        f"called, {len(report.private_gone)} private gone, {len(report.bodies_changed)} "
        "bodies changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
