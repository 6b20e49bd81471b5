"""scripts/vllm_api_drift.py: the vLLM API drift report.

Synthetic: two tiny fake vLLM trees and a fake "our code" directory, one change of each
kind. Real (skipped unless patch_rebase's sdist cache holds them): vLLM 0.26.0 -> 0.32.0
must flag ``OffloadingManager.touch`` as no longer called, 0.32.0 -> 0.34.0 the new
``OffloadingWorker.submit_store`` / ``submit_load`` signatures.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from helpers.kvutil import load_script
from helpers.patchutil import cached_sdist

drift = load_script("vllm_api_drift")

OFFLOADING = "vllm/distributed/kv_transfer/kv_connector/v1/offloading"
SCHED = f"{OFFLOADING}/scheduler.py"

BASE = {
    "vllm/__init__.py": "",
    "vllm/v1/kv_offload/base.py": '''
        from abc import ABC, abstractmethod
        from dataclasses import dataclass

        LIMIT = 4


        @dataclass
        class Event:
            keys: list[int]
            medium: str
            owner: str = ""


        class OffloadingManager(ABC):
            @abstractmethod
            def lookup(self, key: int) -> bool: ...

            def touch(self, keys: list[int]) -> None:
                """Mark keys used."""

            def stats(self) -> dict:
                return {}

            def evict(self) -> None:
                pass


        def make_key(h: bytes, group: int = 0) -> bytes:
            return h + bytes([group])


        def unchanged_func(a: int) -> int:
            return a


        class Unchanged:
            def __init__(self) -> None:
                self.x = 1

            def run(self, x: int) -> int:
                return x
        ''',
    "vllm/v1/kv_offload/__init__.py": "from .base import Unchanged  # re-export\n",
    SCHED: '''
        from vllm.v1.kv_offload.base import OffloadingManager

        KEY = "tiers"


        class OffloadingConnectorScheduler:
            def __init__(self, manager: OffloadingManager) -> None:
                self.manager = manager
                self._req_status: dict = {}
                self._jobs = {}

            def lookup(self, key: int) -> bool:
                hit = self.manager.lookup(key)
                self.manager.touch([key])
                return hit

            def build(self) -> dict:
                return self.manager.stats()
        ''',
    # same-named calls the call-site rule must not count for the manager
    "vllm/v1/kv_offload/cpu/manager.py": '''
        class Policy:
            def touch(self, keys): pass


        class CPUManager:
            def __init__(self):
                self._policy = Policy()

            def touch(self, keys):
                self._policy.touch(keys)
        ''',
    "vllm/misc.py": '''
        from pathlib import Path


        def mark(p):
            Path(p).touch()
        ''',
}

NEW = dict(BASE)
NEW.update({
    "vllm/v1/kv_offload/base.py": '''
        from abc import ABC, abstractmethod
        from dataclasses import dataclass


        @dataclass
        class Event:
            keys: list[int]
            medium: int
            owner: int = 0
            locality: str | None = None


        class OffloadingManager(ABC):
            @abstractmethod
            def lookup(self, key: int) -> bool: ...

            @abstractmethod
            def release(self) -> None: ...

            def touch(self, keys: list[int]) -> None:
                """Mark keys used."""

            def stats(self) -> dict:
                return {"n": 0}

            def evict(self) -> None:
                pass


        def make_key(digest: bytes, group: int = 0) -> bytes:
            return digest + bytes([group])


        def unchanged_func(a: int) -> int:
            return a


        class Unchanged:
            def __init__(self) -> None:
                self.x = 1

            def run(self, x: int) -> int:
                return x
        ''',
    SCHED: '''
        from vllm.v1.kv_offload.base import OffloadingManager

        KEY = "tiers"


        class OffloadingConnectorScheduler:
            def __init__(self, manager: OffloadingManager) -> None:
                self.manager = manager
                self._req_status: dict = {}

            def lookup(self, key: int) -> bool:
                return self.manager.lookup(key)

            def build(self) -> dict:
                return self.manager.stats()
        ''',
})

OURS = {
    "ourpkg/__init__.py": "",
    "ourpkg/manager.py": '''
        from vllm.v1.kv_offload import Unchanged
        from vllm.v1.kv_offload.base import (
            LIMIT,
            Event,
            OffloadingManager,
            make_key,
            unchanged_func,
        )


        class MyManager(OffloadingManager):
            def lookup(self, key):
                return True

            def touch(self, keys):
                self.keys = keys

            def stats(self):
                return super().stats()

            def evict(self):
                pass

            def helper(self):  # ours, overrides nothing
                return make_key(b"x"), Event([], 1).medium, LIMIT, unchanged_func, Unchanged
        ''',
    "ourpkg/sched.py": '''
        def tiers():
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading import (
                scheduler as S,
            )

            return S.KEY
        ''',
}

PRIVATE = (
    drift.Private(SCHED, "OffloadingConnectorScheduler._req_status", "ours.a"),
    drift.Private(SCHED, "OffloadingConnectorScheduler._jobs", "ours.b"),
    drift.Private(SCHED, "OffloadingConnectorScheduler.lookup", "ours.c"),
)


def _write(root, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text).lstrip())
    return str(root)


@pytest.fixture
def synthetic(tmp_path):
    base = _write(tmp_path / "base", BASE)
    new = _write(tmp_path / "new", NEW)
    ours = os.path.join(_write(tmp_path / "ours", OURS), "ourpkg")
    report = drift.compare(drift.Tree(base, "1.0"), drift.Tree(new, "2.0"), ours, PRIVATE)
    return report, (base, new, ours)


def _line(files: dict[str, str], rel: str, needle: str) -> str:
    """``rel:line`` of the first line of ``files[rel]`` (as written) containing ``needle``."""
    lines = textwrap.dedent(files[rel]).lstrip().splitlines()
    return f"{rel}:{next(i for i, ln in enumerate(lines, 1) if needle in ln)}"


def _names(rows) -> set[str]:
    return {r["name"] for r in rows}


def _row(rows, name):
    return next(r for r in rows if r["name"] == name)


def test_signature_changes(synthetic):
    report, _ = synthetic
    mk = _row(report.changed, "make_key")
    assert mk["incompatible"] and "`h: bytes` -> `digest: bytes` (position 0)" in mk["change"]
    ev = _row(report.changed, "Event.__init__")  # dataclass constructor
    assert not ev["incompatible"] and "added optional `locality: str | None = None`" in \
        ev["change"] and "`medium`: `str` -> `int`" in ev["change"]
    assert _row(report.changed, "Event.medium")["new"] == "int"
    # a member of a class we only import that our code never names is not our surface
    assert "Event.owner" not in _names(report.changed)
    assert mk["where"] == _line(NEW, "vllm/v1/kv_offload/base.py", "def make_key")
    assert "ourpkg/manager.py:2" in mk["used_by"]


def test_removed_and_private_gone(synthetic):
    report, _ = synthetic
    assert _names(report.removed) == {"LIMIT"}
    assert _row(report.removed, "LIMIT")["base_where"] == _line(
        BASE, "vllm/v1/kv_offload/base.py", "LIMIT = 4")
    assert _names(report.private_gone) == {"OffloadingConnectorScheduler._jobs"}
    assert _row(report.private_gone, "OffloadingConnectorScheduler._jobs")["used_by"] == \
        "ours.b"


def test_new_abstract_method(synthetic):
    report, _ = synthetic
    ab = _row(report.new_abstract, "OffloadingManager.release")
    assert ab["implemented_by"] == [] and ab["sig"] == "(self) -> None"
    assert "OffloadingManager.release" in _names(report.added)


def test_no_longer_called_and_dead_overrides(synthetic):
    report, _ = synthetic
    calls = {r["name"]: r for r in report.calls}
    assert set(calls) == {"MyManager.lookup", "MyManager.touch", "MyManager.stats",
                          "MyManager.evict"}  # helper overrides nothing
    touch = calls["MyManager.touch"]
    # only the offloading scheduler's self.manager.touch: not the CPU policy's or Path's
    assert touch["sites_base"] == [_line(BASE, SCHED, "self.manager.touch(")]
    assert touch["calls_new"] == 0
    assert _names(report.not_called) == {"MyManager.touch"}
    assert _names(report.dead_overrides) == {"MyManager.evict"}
    assert calls["MyManager.lookup"]["calls_new"] == 1
    assert calls["MyManager.stats"]["calls_new"] == 1


def test_bodies_changed(synthetic):
    report, _ = synthetic
    bodies = {r["name"]: r for r in report.bodies_changed}
    assert set(bodies) == {"OffloadingManager.stats", "OffloadingConnectorScheduler.lookup"}
    assert bodies["OffloadingManager.stats"]["overridden"]
    assert bodies["OffloadingManager.stats"]["what"] == "code"


def test_unchanged_things_stay_out_of_the_change_tables(synthetic):
    report, _ = synthetic
    for name in ("unchanged_func", "Unchanged", "KEY",
                 "OffloadingConnectorScheduler._req_status"):
        assert name in report.unchanged
    changed = set().union(*(_names(rows) for rows in (
        report.changed, report.removed, report.new_abstract, report.not_called,
        report.private_gone, report.bodies_changed)))
    assert not {n for n in changed if n.split(".")[0] in ("unchanged_func", "Unchanged",
                                                           "KEY")}
    assert "OffloadingManager.lookup" not in changed and "MyManager.lookup" not in changed


def test_cli_on_trees_writes_md_and_json(synthetic, tmp_path):
    _, (base, new, ours) = synthetic
    out = tmp_path / "docs" / "drift.md"
    rc = drift.main(["--base-tree", base, "--new-tree", new, "--ours", ours,
                     "--base", "1.0", "--new", "2.0", "--out", str(out)])
    assert rc == 0
    md = out.read_text()
    for section in ("## Changed signatures", "## Removed", "## New abstract methods",
                    "## No longer called by vLLM", "## Private attributes gone",
                    "## Bodies changed"):
        assert section in md
    assert "# vLLM API drift: 1.0 -> 2.0" in md and "`MyManager.touch`" in md
    data = json.loads((tmp_path / "docs" / "drift.json").read_text())
    assert data["base"] == "1.0" and data["new"] == "2.0"
    # the CLI uses the script's own curated list: its `_jobs` entry matches the fake
    # scheduler; the entries the fake trees lack are noted, not reported gone
    assert _names(data["private_gone"]) == {"OffloadingConnectorScheduler._jobs"}
    assert any("not found in either release" in n for n in data["notes"])


def test_bad_arguments_exit_2(tmp_path, synthetic):
    _, (base, new, ours) = synthetic
    empty = str(tmp_path / "empty-cache")
    assert drift.main(["--offline", "--cache-dir", empty, "--base", "0.26.0",
                       "--new-tree", new, "--out", "-"]) == 2
    assert drift.main(["--base-tree", str(tmp_path), "--new-tree", new, "--out", "-"]) == 2
    assert drift.main(["--base-tree", base, "--new-tree", new, "--ours",
                       str(tmp_path / "nowhere"), "--out", "-"]) == 2


def test_default_base_is_the_newest_runtime_line():
    base = drift.default_base()
    p = drift.rebase._patching
    assert p.release_line(base) == max(p.RUNTIME_LINES, key=lambda v: tuple(
        int(x) for x in v.split(".")))


# ------------------------------------------------------------------ real sdists
def _real(tmp_path, base: str, new: str) -> dict:
    cached_sdist(base, need_patch=False)
    cached_sdist(new, need_patch=False)
    out = tmp_path / "drift.md"
    assert drift.main(["--base", base, "--new", new, "--offline", "--out", str(out)]) == 0
    return json.loads((tmp_path / "drift.json").read_text())


def test_real_026_to_032_touch_no_longer_called(tmp_path):
    data = _real(tmp_path, "0.26.0", "0.32.0")
    touch = _row(data["not_called"], "PyKVCacheManager.touch")
    assert touch["calls_base"] > 0 and touch["calls_new"] == 0
    assert all(s.startswith(f"{OFFLOADING}/scheduler.py:") for s in touch["sites_base"])


def test_real_032_to_034_worker_signatures(tmp_path):
    data = _real(tmp_path, "0.32.0", "0.34.0")
    for name, param in (("OffloadingWorker.submit_store", "device_ptrs: DevicePointers"),
                        ("OffloadingWorker.submit_load", "device_ptrs: DevicePointers")):
        row = _row(data["changed"], name)
        assert row["incompatible"] and param in row["change"]
        assert "PyKVCacheWorker" in row["used_by"]
    assert "PyKVCacheManager.touch" in _names(data["dead_overrides"])
