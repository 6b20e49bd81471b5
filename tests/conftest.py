"""Shared fixtures: real roots on disk, real io_uring / POSIX engines, real processes."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from kvcache_core.copy import MemcpyCopier
from kvcache_core.io import uring_available
from kvcache_core.layout import Layout, Namespace
from kvcache_core.reactor import Reactor

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from helpers.kvutil import BLOCK, close_reactor, open_fds_under  # noqa: E402

settings.register_profile("kvcache", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvcache")


def _uring_ok() -> tuple[bool, str]:
    saved = os.environ.pop("KVCACHE_DISABLE_IO_URING", None)
    try:
        return uring_available()
    finally:
        if saved is not None:
            os.environ["KVCACHE_DISABLE_IO_URING"] = saved


URING_OK, URING_WHY = _uring_ok()
ENGINES = ["io_uring", "posix"]


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    if request.param == "io_uring" and not URING_OK:
        pytest.skip(f"io_uring unavailable here: {URING_WHY}")
    return request.param


@pytest.fixture(scope="session")
def vllm_available() -> None:
    """Skip where vLLM cannot be imported (tests/vllm and tests/e2e need it)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # pragma: no cover
        pytest.skip(f"vLLM not importable: {e}")


@pytest.fixture
def ns() -> Namespace:
    return Namespace(model="test/model", dtype="bfloat16", block_size=16, block_bytes=BLOCK)


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "root")


@pytest.fixture
def no_fd_leak(request, tmp_path):
    """Fail the test if any fd under tmp_path is still open once everything is closed
    (not checked when a reactor had to be stopped by force: the test already failed)."""
    request.node.kv_forced_close = False
    yield
    if request.node.kv_forced_close:
        return
    left = open_fds_under(str(tmp_path))
    assert not left, f"file descriptors leaked: {left}"


@pytest.fixture
def make_layout(no_fd_leak, root, ns):
    made: list[Layout] = []

    def make(r: str | None = None, n: Namespace | None = None, **kw) -> Layout:
        lay = Layout(r or root, n or ns, **kw)
        made.append(lay)
        return lay

    yield make
    for lay in reversed(made):
        lay.close()


@pytest.fixture
def make_reactor(request, make_layout, engine):
    made: list[Reactor] = []

    def make(layout: Layout, **kw) -> Reactor:
        kw.setdefault("copier", MemcpyCopier)
        kw.setdefault("pin", False)
        kw.setdefault("engine", engine)
        kw.setdefault("n_slots", 6)
        kw.setdefault("io_depth", 4)
        r = Reactor(layout, **kw)
        made.append(r)
        return r

    yield make
    for r in reversed(made):
        if not close_reactor(r):
            request.node.kv_forced_close = True


# ---------------------------------------------------------------- GlusterFS (issue 16)
@pytest.fixture(scope="session")
def gluster():
    """One glusterd on 127.0.0.1 for the whole session (tests/helpers/gluster.py), shared
    by tests/test_glusterfs.py and the two-engine test in tests/e2e; skipped with one
    line where GlusterFS cannot run."""
    from helpers.gluster import GlusterSession, GlusterUnavailable

    gs = GlusterSession()
    try:
        gs.start()
    except GlusterUnavailable as e:
        gs.close()
        pytest.skip(f"GlusterFS unavailable: {e}")
    yield gs
    problems = gs.close()
    assert not problems, f"GlusterFS teardown: {problems}"


@pytest.fixture
def mounts(gluster, request):
    """(layout, mount 1, mount 2, a fresh root name) of the session's volume of the
    layout (created by the first test that needs it, reused by the others)."""
    import time

    m1, m2 = gluster.volume(request.param)
    return request.param, m1, m2, f"root-{request.param}-{time.time_ns()}"
