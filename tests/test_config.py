"""StorageConfig units: defaults, JSON round trip, unknown keys and bad values named,
the staging pool check."""

from __future__ import annotations

import json

import pytest
from helpers.kvutil import assert_config_error_names_key

from kvcache_core.config import ConfigError, StorageConfig


def test_config_defaults_and_round_trip():
    cfg = StorageConfig()
    assert set(StorageConfig.keys()) >= {"root_dir", "staging_bytes", "io_depth", "lookahead",
                                         "copy_headroom", "dram_cache_bytes",
                                         "eviction_policy", "block_size", "max_disk_bytes",
                                         "durable"}
    d = {k: getattr(cfg, k) for k in StorageConfig.keys()}
    assert StorageConfig.from_dict(d) == cfg
    assert StorageConfig.from_json(json.dumps(d)) == cfg
    c2 = StorageConfig.from_dict({"io_depth": 4, "spec_name": "X"}, allowed_extra=("spec_name",))
    assert c2.io_depth == 4 and c2.extra == {"spec_name": "X"}


def test_config_unknown_key_is_named():
    with pytest.raises(ConfigError) as ei:
        StorageConfig.from_dict({"root_dir": "/x", "io_dept": 4})
    assert "'io_dept'" in str(ei.value)
    assert "io_depth" in str(ei.value)  # the valid keys are listed
    with pytest.raises(ConfigError, match="'spec_name'"):
        StorageConfig.from_dict({"spec_name": "PyKVCacheSpec"})
    with pytest.raises(ConfigError, match="'extra'"):
        StorageConfig.from_dict({"extra": {}})


@pytest.mark.parametrize("key,value", [
    ("io_depth", 0),
    ("io_depth", 257),
    ("io_depth", "8"),
    ("io_depth", True),
    ("io_depth", 2.5),
    ("staging_bytes", 0),
    ("staging_bytes", -1),
    ("lookahead", -1),
    ("copy_headroom", -2),
    ("dram_cache_bytes", -1),
    ("block_size", 0),
    ("max_disk_bytes", -5),
    ("max_disk_bytes", None),
    ("root_dir", ""),
    ("root_dir", 5),
    ("eviction_policy", "fifo"),
    ("direct_io", True),
    ("direct_io", "yes"),
    ("io_async", True),
    ("io_async", "always"),
    ("engine", "spdk"),
    ("durable", "yes"),
    ("durable", 1),
    ("verify_checksum", "no"),
    ("switch_interval_s", -0.001),
    ("switch_interval_s", 0.5),
    ("switch_interval_s", True),
    ("switch_interval_scope", "loads"),
    ("preload_keep_s", -1),
    ("preload_keep_s", 3601),
    ("preload_keep_s", "30"),
    ("preload_keep_s", True),
    ("writeback_defer_s", -0.01),
    ("writeback_defer_s", 11),
    ("writeback_defer_s", "0.05"),
    ("writeback_defer_s", False),
    ("preload_depth", 0),
    ("preload_depth", 65),
    ("preload_depth", "2"),
    ("preload_depth", True),
    ("write_depth_reading", -1),
    ("write_depth_reading", 9),  # above the default io_depth (8)
    ("write_depth_reading", "1"),
    ("write_depth_reading", True),
])
def test_config_bad_value_names_the_key(key, value):
    assert_config_error_names_key(key, value)


def test_config_json_errors_and_pool_check():
    with pytest.raises(ConfigError, match="JSON"):
        StorageConfig.from_json("{not json")
    with pytest.raises(ConfigError, match="object"):
        StorageConfig.from_json("[1, 2]")
    cfg = StorageConfig(staging_bytes=10 * 4096, io_depth=8, copy_headroom=4)
    with pytest.raises(ConfigError, match="'staging_bytes'"):
        cfg.check_pool(4096)
    StorageConfig(staging_bytes=12 * 4096, io_depth=8, copy_headroom=4).check_pool(4096)
    StorageConfig(staging_bytes=9 * 4096, io_depth=8, copy_headroom=0).check_pool(4096)
