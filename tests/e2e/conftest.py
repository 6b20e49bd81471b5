"""End-to-end tests against real vLLM 0.26 (CPU platform).

The environment is fixed here, BEFORE anything imports vLLM: a 1 GiB KV cache, no
TorchDynamo, and the engine core in this process (so tests can reach the scheduler's
manager and several engines can run one after the other; each is shut down).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from . import helpers as H

for _k, _v in H.ENV.items():
    os.environ[_k] = _v


def pytest_collection_modifyitems(items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def workdir():
    d = tempfile.mkdtemp(prefix="pykv_e2e_")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(workdir, vllm_available) -> str:
    return H.write_model(os.path.join(workdir, "tiny-llama"))


@pytest.fixture(scope="session")
def reference(model_dir) -> dict:
    """Greedy outputs of every prompt with no connector at all (plain recompute)."""
    llm = H.make_llm(model_dir, None)
    try:
        return {name: H.generate(llm, p) for name, p in H.PROMPTS.items()}
    finally:
        H.shutdown(llm)
