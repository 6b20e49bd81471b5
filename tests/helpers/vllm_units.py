"""Helpers shared by the fast unit tests of the vLLM glue (``tests/vllm``); no vLLM or
pytest import here."""

from __future__ import annotations


def key(i: int, group: int = 0) -> bytes:
    """A chunk key as vLLM 0.26 builds them (32-byte block hash + 4-byte KV group)."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")
