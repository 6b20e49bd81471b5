"""Fast tests of :mod:`kvcache_core.vllm.options` without an engine: config parsing,
the hash seed, the model identity."""

from __future__ import annotations

import os

import pytest

from kvcache_core.config import ConfigError, StorageConfig
from kvcache_core.layout import Namespace
from kvcache_core.vllm import options as O


def test_parse_extra_config_errors_name_the_key():
    base = {"spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
            "root_dir": "/tmp/x"}
    with pytest.raises(ConfigError, match=r"unknown config key 'io_depht'.*did you mean "
                                          r"'io_depth'"):
        O.parse_extra_config({**base, "io_depht": 3})
    with pytest.raises(ConfigError, match="'io_depth'"):
        O.parse_extra_config({**base, "io_depth": 0})
    with pytest.raises(ConfigError, match="'block_size' and 'blocks_per_chunk'"):
        O.parse_extra_config({**base, "block_size": 256, "blocks_per_chunk": 2})
    with pytest.raises(ConfigError, match="'blocks_per_chunk'"):
        O.parse_extra_config({**base, "blocks_per_chunk": "2"})
    with pytest.raises(ConfigError, match="'offload_prompt_only'"):
        O.parse_extra_config({**base, "offload_prompt_only": "yes"})
    with pytest.raises(ConfigError, match="'load_failure_policy'"):
        O.parse_extra_config({**base, "load_failure_policy": "ignore"})
    with pytest.raises(ConfigError, match="'breakeven_table'"):
        O.parse_extra_config({**base, "breakeven_table": ""})
    with pytest.raises(ConfigError, match="'queue_aware_preload'.*true or false"):
        O.parse_extra_config({**base, "breakeven_table": "t.json", "queue_aware_preload": 1})
    with pytest.raises(ConfigError, match="'queue_aware_preload': needs 'breakeven_table'"):
        O.parse_extra_config({**base, "queue_aware_preload": True})
    with pytest.raises(ConfigError, match="'disk_backlog_gate'.*true or false"):
        O.parse_extra_config({**base, "breakeven_table": "t.json", "disk_backlog_gate": 1})
    with pytest.raises(ConfigError, match="'disk_backlog_gate': needs 'breakeven_table'"):
        O.parse_extra_config({**base, "disk_backlog_gate": True})
    assert O.parse_extra_config({**base, "breakeven_table": "t.json",
                                 "disk_backlog_gate": True}).disk_backlog_gate
    assert not O.parse_extra_config(base).disk_backlog_gate
    with pytest.raises(ConfigError, match="'gate_balance'.*true or false"):
        O.parse_extra_config({**base, "breakeven_table": "t.json", "gate_balance": "on"})
    with pytest.raises(ConfigError, match="'gate_balance': needs 'breakeven_table'"):
        O.parse_extra_config({**base, "gate_balance": True})
    assert O.parse_extra_config({**base, "breakeven_table": "t.json",
                                 "gate_balance": True}).gate_balance
    assert not O.parse_extra_config(base).gate_balance
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="'preload_protect'.*true, false or 'auto'"):
            O.parse_extra_config({**base, "preload_protect": bad})
    assert O.parse_extra_config({**base, "preload_protect": True}).preload_protect is True
    assert O.parse_extra_config({**base, "preload_protect": False}).preload_protect is False
    assert O.parse_extra_config(base).preload_protect == "auto"
    for bad in (-1, 3601, "30", True, float("nan"), None):
        with pytest.raises(ConfigError, match="'disk_load_hold_s'.*0..3600"):
            O.parse_extra_config({**base, "disk_load_hold_s": bad})
    # on by default (30 s) since the forty-first session; 0 turns it off
    assert O.parse_extra_config(base).disk_load_hold_s == 30.0
    assert O.parse_extra_config({**base, "disk_load_hold_s": 0}).disk_load_hold_s == 0.0
    assert O.parse_extra_config({**base, "disk_load_hold_s": 5}).disk_load_hold_s == 5.0
    for bad in (True, "yes", None, 1):
        with pytest.raises(ConfigError, match="'disk_lookup_async'.*'auto', 'on' or 'off'"):
            O.parse_extra_config({**base, "disk_lookup_async": bad})
    assert O.parse_extra_config(base).disk_lookup_async == "off"
    for bad in ("true", 1, None):
        with pytest.raises(ConfigError, match="'disk_warm_start'.*true or false"):
            O.parse_extra_config({**base, "disk_warm_start": bad})
    assert O.parse_extra_config(base).disk_warm_start is True
    assert O.parse_extra_config({**base, "disk_warm_start": False}).disk_warm_start is False
    assert O.parse_extra_config({**base, "disk_lookup_async": "on"}).disk_lookup_async == "on"
    for bad in (0, 65, "2", True, 1.5, None):
        with pytest.raises(ConfigError, match="'disk_load_hold_requests'.*1..64"):
            O.parse_extra_config({**base, "disk_load_hold_requests": bad})
    assert O.parse_extra_config(base).disk_load_hold_requests == 1
    assert O.parse_extra_config({**base, "disk_load_hold_requests": 2}
                                ).disk_load_hold_requests == 2
    for bad in (-1, 1025, "16", True, 1.5, None):
        with pytest.raises(ConfigError, match="'preload_protect_requests'.*0..1024"):
            O.parse_extra_config({**base, "preload_protect_requests": bad})
    assert O.parse_extra_config(base).preload_protect_requests == 0
    assert O.parse_extra_config({**base, "preload_protect_requests": 16}
                                ).preload_protect_requests == 16
    assert O.parse_extra_config({**base, "breakeven_table": "t.json",
                                 "queue_aware_preload": True}).queue_aware_preload
    for bad in (-1, "4k", True, 1.5):
        with pytest.raises(ConfigError, match="'disk_min_prefix_tokens'"):
            O.parse_extra_config({**base, "disk_min_prefix_tokens": bad})
    assert O.parse_extra_config(base).disk_min_prefix_tokens == "auto"
    assert O.parse_extra_config({**base, "disk_min_prefix_tokens": 4096}
                                ).disk_min_prefix_tokens == 4096
    for bad in (-1, "2k", False, 2.5):
        with pytest.raises(ConfigError, match="'min_store_prefix_tokens'"):
            O.parse_extra_config({**base, "min_store_prefix_tokens": bad})
    assert O.parse_extra_config(base).min_store_prefix_tokens == "auto"
    assert O.parse_extra_config({**base, "min_store_prefix_tokens": 2048}
                                ).min_store_prefix_tokens == 2048
    with pytest.raises(ConfigError, match="'dram_cache_bytes'"):
        O.pool_geometry(StorageConfig(dram_cache_bytes=4096),
                        Namespace("m", "bf16", 256, 1 << 20))
    opts = O.parse_extra_config({**base, "block_size": 512})
    with pytest.raises(ConfigError, match="'block_size'"):
        O.check_block_size(opts, 96)
    O.check_block_size(opts, 128)
    assert O.resolve_blocks_per_chunk(opts, (128,), 4) == 4
    dflt = O.parse_extra_config(base)
    assert O.resolve_blocks_per_chunk(dflt, (16,), 1) == 16  # 256 tokens, not 1 block
    assert O.resolve_blocks_per_chunk(dflt, (128,), 1) == 2


def test_gpu_kv_layout_option():
    assert O.parse_extra_config({}).gpu_kv_layout == "cross_layer"
    assert O.parse_extra_config({"gpu_kv_layout": "per_layer"}).gpu_kv_layout == "per_layer"
    for bad in ("NHD", "", True, 1):
        with pytest.raises(ConfigError, match="'gpu_kv_layout': must be 'cross_layer' or "
                                              "'per_layer'"):
            O.parse_extra_config({"gpu_kv_layout": bad})


def test_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(O, "_seed_set_by_us", False)
    assert O.ensure_hash_seed() == "0" and os.environ["PYTHONHASHSEED"] == "0"
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert O.ensure_hash_seed() == "1234"
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    with pytest.raises(ConfigError, match="PYTHONHASHSEED=random"):
        O.ensure_hash_seed()


def test_disk_lookup_cache_option():
    from kvcache_core.config import ConfigError
    from kvcache_core.vllm.options import parse_extra_config

    assert parse_extra_config({}).disk_lookup_cache_s == "auto"
    assert parse_extra_config({"disk_lookup_cache_s": 0.5}).disk_lookup_cache_s == 0.5
    for bad in (-1, "2s", True, 4000):
        with pytest.raises(ConfigError, match="'disk_lookup_cache_s'"):
            parse_extra_config({"disk_lookup_cache_s": bad})


def _mc(model: str, **kw):
    from types import SimpleNamespace

    cfg = kw.pop("cfg", {"hidden_size": 256, "num_hidden_layers": 2, "rope_theta": 1e4})
    hf = SimpleNamespace(to_dict=lambda: {**cfg, "_name_or_path": model})
    return SimpleNamespace(model=model, revision=kw.get("revision"),
                           quantization=kw.get("quantization"),
                           hf_overrides=kw.get("hf_overrides"), hf_config=hf)


def test_model_identity_changes_with_everything_that_changes_the_kv(tmp_path):
    """Issue 12 item 3: revision, quantization, hf_overrides, the model config, the load
    format and the weight files each change the identity (so the namespace); the path
    the same weights are read from does not."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model-00001.safetensors").write_bytes(b"w" * 200_000)
        (d / "config.json").write_text("{}")
    base, parts = O.model_identity(_mc(str(a)), "auto")
    assert len(base) == 16 and parts["weights"] and parts["config"]
    assert O.model_identity(_mc(str(b)), "auto")[0] == base  # same weights, other path
    variants = [
        O.model_identity(_mc(str(a), revision="v2"), "auto"),
        O.model_identity(_mc(str(a), quantization="fp8"), "auto"),
        O.model_identity(_mc(str(a), hf_overrides={"rope_theta": 2e4}), "auto"),
        O.model_identity(_mc(str(a), cfg={"hidden_size": 256, "num_hidden_layers": 3}),
                         "auto"),
        O.model_identity(_mc(str(a)), "dummy"),
    ]
    digests = [v[0] for v in variants]
    assert base not in digests and len(set(digests)) == len(digests)
    # weights updated in place (same names and sizes, new values at the end of the file)
    with open(a / "model-00001.safetensors", "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"0123456789")
    assert O.model_identity(_mc(str(a)), "auto")[0] != base
    # a hub name (no local directory): no weights part, still deterministic
    hub = O.model_identity(_mc("meta-llama/Llama-3.2-3B"), "auto")
    assert hub == O.model_identity(_mc("meta-llama/Llama-3.2-3B"), "auto")
    assert hub[1]["weights"] == ""
