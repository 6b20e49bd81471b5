"""The vLLM plugin (issue 13 item 3): a wrong ``kv_connector_extra_config`` key or value
is reported when the config is parsed, before any model load, as one message naming the
key; other connectors' configs are untouched; one warning when preload cannot run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from kvcache_core.config import ConfigError

from . import helpers as H

BAD = r"unknown config key 'io_depht' \(did you mean 'io_depth'\?\)"


@pytest.fixture
def plugin(vllm_available):
    from kvcache_core.vllm import plugin as P

    P.register()
    return P


@pytest.fixture
def config_only_model(tmp_path) -> str:
    """A model directory with config.json only: no weights, nothing could be loaded."""
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(H.MODEL_CONFIG))
    return str(d)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def vllm_log():
    """Records of ``vllm.pykvcache`` (vLLM's logger does not propagate to caplog)."""
    h = _Records()
    lg = logging.getLogger("vllm.pykvcache")
    lg.addHandler(h)
    try:
        yield h
    finally:
        lg.removeHandler(h)


def _ours(root: str, **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvcache_core.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "PyKVCacheSpec",
                                          "spec_module_path": "kvcache_core.vllm",
                                          "root_dir": root, **extra}}


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("py_kvcache") == "kvcache_core.vllm.plugin:register", (
        f"entry point missing ({eps}): `.venv/bin/pip install --no-deps --no-build-isolation "
        "-e .` refreshes it")


def test_register_wraps_once_and_never_raises(plugin, monkeypatch):
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    post, create = KVTransferConfig.__post_init__, EngineArgs.create_engine_config
    plugin.register()
    plugin.register()
    assert KVTransferConfig.__post_init__ is post
    assert EngineArgs.create_engine_config is create
    assert not getattr(post.__wrapped__, plugin._MARK, False)  # one layer, not three

    def boom() -> None:
        raise RuntimeError("vLLM moved things around")

    monkeypatch.setattr(plugin, "_install_hooks", boom)
    assert plugin.register() is None


def test_bad_key_raises_when_the_config_is_built(plugin, tmp_path, vllm_log):
    """(a) KVTransferConfig itself refuses it: what --kv-transfer-config parses into."""
    from vllm.config.kv_transfer import KVTransferConfig

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=BAD):
        KVTransferConfig(**_ours(str(tmp_path / "kv"), io_depht=8))
    assert time.monotonic() - t0 < 2.0  # vs 40-53 s of model load before the plugin
    # logged first, as one line (argparse prints its usage before the error)
    (msg,) = vllm_log.messages(logging.ERROR)
    assert "io_depht" in msg and "io_depth" in msg and "\n" not in msg
    with pytest.raises(ValueError, match=r"'io_depth'"):  # a bad value names its key too
        KVTransferConfig(**_ours(str(tmp_path / "kv"), io_depth=0))


def test_bad_key_raises_in_create_engine_config_before_any_model_load(
        plugin, tmp_path, config_only_model):
    """(a) A KVTransferConfig built before the plugin was loaded (``LLM(kv_transfer_config=
    KVTransferConfig(...))``) is checked when the engine config is created: there are no
    weights in the model directory, so reaching the model load would fail differently."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    cfg = KVTransferConfig(**_ours(str(tmp_path / "kv")))
    cfg.kv_connector_extra_config["io_depht"] = 8  # not re-validated on assignment
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=BAD):
        EngineArgs(model=config_only_model, kv_transfer_config=cfg).create_engine_config()
    assert time.monotonic() - t0 < 10.0


def test_other_connectors_are_untouched(plugin, tmp_path, vllm_log):
    """(b) No kvcache_core module path (nor our spec): nothing is validated or logged."""
    from vllm.config.kv_transfer import KVTransferConfig

    extra = {"shared_storage_path": str(tmp_path), "io_depht": 8}
    cfg = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                           kv_connector_extra_config=dict(extra))
    assert cfg.kv_connector_extra_config == extra
    plugin.validate_kv_transfer_config(cfg)
    plugin.validate_kv_transfer_config(None)
    assert KVTransferConfig().kv_connector is None
    assert vllm_log.records == []


def test_our_spec_behind_vllms_connector_is_checked_too(plugin, tmp_path):
    from vllm.config.kv_transfer import KVTransferConfig

    d = _ours(str(tmp_path / "kv"), io_depht=8)
    del d["kv_connector_module_path"]
    with pytest.raises(ValueError, match=BAD):
        KVTransferConfig(**d)


def test_patched_check_agrees_with_patching(plugin):
    from kvcache_core.patching import is_patched

    assert plugin.vllm_is_patched() == is_patched()
    assert os.path.isdir(os.path.join(plugin.vllm_site_dir(), "vllm"))


@pytest.mark.parametrize("patched", [False, True])
def test_preload_warning_once_per_process_when_unpatched(plugin, tmp_path, vllm_log,
                                                         monkeypatch, patched):
    """(c) preload_lookahead > 0 (default 4) on an unpatched vLLM: ONE warning naming the
    fix; none when patched, none with preload_lookahead 0."""
    from vllm.config.kv_transfer import KVTransferConfig

    monkeypatch.setattr(plugin, "_preload_warned", False)
    monkeypatch.setattr(plugin, "vllm_is_patched", lambda: patched)
    KVTransferConfig(**_ours(str(tmp_path / "kv"), preload_lookahead=0))
    assert vllm_log.messages(logging.WARNING) == []
    for _ in range(3):
        KVTransferConfig(**_ours(str(tmp_path / "kv")))
    warnings = vllm_log.messages(logging.WARNING)
    if patched:
        assert warnings == []
    else:
        (w,) = warnings
        assert "preload is INACTIVE" in w
        assert f"kvcache patch-vllm --target {plugin.vllm_site_dir()}" in w


def test_api_server_exits_on_a_bad_key_before_loading_the_model(vllm_available, tmp_path):
    """(d) ``vllm serve``'s entry: the bad key ends the process at argument parsing, with
    our one-line message before anything else of substance (argparse's usage follows)."""
    model = H.write_model(str(tmp_path / "tiny-llama"))
    kvt = json.dumps(_ours(str(tmp_path / "kv"), io_depht=8))
    env = dict(os.environ)
    env.update(H.ENV)
    # the editable install's metadata (not a stale egg-info of the source tree) names
    # the entry point: run from elsewhere
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                            "--model", model, "--kv-transfer-config", kvt],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:  # pragma: no cover - the failure being tested
        pytest.fail(f"the server did not stop on the bad key within 120 s: {e.output!r}")
    took = time.monotonic() - t0
    if "No module named" in r.stdout and "io_depht" not in r.stdout:
        pytest.skip(f"the API server cannot start in this venv: {r.stdout[-500:]}")
    out = r.stdout.splitlines()  # stdout and stderr interleaved as written
    assert r.returncode != 0
    ours = [i for i, ln in enumerate(out)
            if "py-kvcache: unknown config key 'io_depht' (did you mean 'io_depth'?)" in ln]
    assert ours, "\n".join(out[-40:])
    first = ours[0]
    assert "ERROR" in out[first] and "plugin.py" in out[first]
    assert not any("Traceback" in ln for ln in out[:first])
    assert not any("usage:" in ln for ln in out[:first])
    loading = [i for i, ln in enumerate(out) if "Loading" in ln or "load_model" in ln]
    assert not loading or loading[0] > first
    assert not any("Loading weights" in ln or "Model loading took" in ln for ln in out)
    assert took < 100, f"{took:.0f} s"
