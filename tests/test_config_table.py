"""One source for the configuration keys: the README's table is generated from the code
(KEY_HELP, GLUE_KEY_HELP, the defaults), every accepted key is documented there, and the
defaults it shows are the ones the parsers apply."""

from __future__ import annotations

import os

from kvcache_core.config import KEY_HELP, StorageConfig, config_table, readme_with_table
from kvcache_core.vllm import options as O

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_table_is_generated_from_the_code():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert readme_with_table(text) == text, "run scripts/gen_config_table.py"


def test_every_accepted_key_is_in_the_table():
    keys = {row.split("`")[1] for row in config_table()[2:]}
    accepted = set(StorageConfig.keys()) | set(O.VLLM_KEYS) | set(O.GLUE_KEYS)
    assert keys == accepted
    assert set(KEY_HELP) == set(StorageConfig.keys())
    assert set(O.GLUE_DEFAULTS) == set(O.GLUE_KEY_HELP)


def test_shown_glue_defaults_are_the_parsed_ones():
    o = O.parse_extra_config({})
    shown = {"true": True, "false": False, "-": None}
    for key in ("offload_prompt_only", "preload_lookahead", "preload_max_blocks",
                "breakeven_table", "queue_aware_preload", "disk_backlog_gate",
                "gate_balance", "load_failure_policy",
                "disk_min_prefix_tokens", "min_store_prefix_tokens"):
        text = O.GLUE_DEFAULTS[key].strip("`")
        want = shown.get(text, int(text) if text.isdigit() else text)
        assert getattr(o, key) == want, key


def test_storage_defaults_shown():
    rows = {row.split("`")[1]: row for row in config_table()[2:]}
    assert "| 512 MiB |" in rows["staging_bytes"] and "| `0700` |" in rows["dir_mode"]
    assert "| 30 |" in rows["io_timeout_s"] and "| `auto` |" in rows["engine"]
