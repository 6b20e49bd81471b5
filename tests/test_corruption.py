"""Corruption injection: every damaged file is a counted miss, removed, never wrong bytes.

Files are written by the Reactor (store) and by Layout.write_block, then damaged on
disk, then loaded through the Reactor with both engines. Documented behaviour: a short
file, including an empty one, is a CorruptBlock (``loads_corrupt``), not a plain miss.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
from helpers.kvutil import (
    BLOCK,
    finish,
    payload,
    published_bytes,
    read_ledger,
    sentinel_buf,
)

from kvcache_core.layout import HEADER_BYTES, HEADER_FMT, Layout

# header field offsets (HEADER_FMT "<8sIIQQ16sH64sQ" + header hash)
OFF = {"magic": 0, "version": 8, "header_bytes": 12, "payload_len": 16, "block_bytes": 24,
       "ns_digest": 32, "key_len": 48, "key": 50, "payload_hash": 114,
       "header_hash": HEADER_FMT.size}


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _truncate(path: str, size: int) -> None:
    os.truncate(path, size)


# case -> (apply(ctx), same_size): ctx has lay, victim, victim2, ns, root
def _other_namespace(ctx, **changes):
    other_ns = dataclasses.replace(ctx["ns"], **changes)
    other = Layout(ctx["root"], other_ns)
    try:
        key = ctx["victim"]
        assert other.write_block(key, payload(key, other_ns.block_bytes))
        shutil.copyfile(other.path_for(key), ctx["lay"].path_for(key))
    finally:
        other.close()


def _swap(ctx):
    a = ctx["lay"].path_for(ctx["victim"])
    b = ctx["lay"].path_for(ctx["victim2"])
    tmp = a + ".swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


CASES = {
    "truncate_to_0": (lambda c: _truncate(c["path"], 0), False),
    "truncate_mid_header": (lambda c: _truncate(c["path"], 100), False),
    "truncate_header_only": (lambda c: _truncate(c["path"], HEADER_BYTES), False),
    "truncate_mid_payload": (lambda c: _truncate(c["path"], HEADER_BYTES + BLOCK // 2), False),
    "truncate_last_byte": (lambda c: _truncate(c["path"], HEADER_BYTES + BLOCK - 1), False),
    "flip_first_payload_byte": (lambda c: _flip(c["path"], HEADER_BYTES), True),
    "flip_last_payload_byte": (lambda c: _flip(c["path"], HEADER_BYTES + BLOCK - 1), True),
    **{f"flip_header_{name}": ((lambda o: lambda c: _flip(c["path"], o))(off), True)
       for name, off in OFF.items()},
    "other_namespace_geometry": (lambda c: _other_namespace(c, block_bytes=2 * BLOCK), False),
    "other_namespace_same_size": (lambda c: _other_namespace(c, dtype="float8"), True),
    "swap_two_files": (_swap, True),
}


def _write(writer, lay, r, keys):
    if writer == "write_block":
        for k in keys:
            assert lay.write_block(k, payload(k, BLOCK))
    else:
        r.store("w", [(k, payload(k, BLOCK), BLOCK) for k in keys])
        assert finish(r)["w"].ok == [True] * len(keys)


@pytest.mark.parametrize("writer", ["reactor", "write_block"])
@pytest.mark.parametrize("case", list(CASES))
def test_corrupt_file_is_a_counted_removed_miss(make_layout, make_reactor, ns, root, case,
                                                writer):
    lay = make_layout()
    r = make_reactor(lay, n_slots=4, io_depth=2, retain=False)
    good1, victim, good2, victim2 = b"good-1", b"victim-1", b"good-2", b"victim-2"
    keys = [good1, victim, good2, victim2]
    _write(writer, lay, r, keys)
    apply, same_size = CASES[case]
    ctx = {"lay": lay, "ns": ns, "root": root, "victim": victim, "victim2": victim2,
           "path": lay.path_for(victim)}
    apply(ctx)
    bad = {victim, victim2} if case == "swap_two_files" else {victim}

    dests = [sentinel_buf(BLOCK) for _ in keys]
    r.load("load", [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
    c = finish(r)["load"]
    assert c.ok == [k not in bad for k in keys], c
    s = r.stats
    assert s.loads_corrupt == len(bad), r.snapshot()
    assert s.loads_miss == 0 and s.loads_error == 0
    assert s.loads_ok == len(keys) - len(bad)
    for k, d in zip(keys, dests, strict=True):
        if k in bad:
            assert not lay.exists(k), f"corrupt file of {k!r} was not removed"
            assert d == sentinel_buf(BLOCK), "a failed item wrote into its destination"
        else:
            assert lay.exists(k)
            assert bytes(d) == payload(k, BLOCK), f"wrong bytes for {k!r}"
    if same_size:  # removal keeps the ledger exact when the size did not change
        assert read_ledger(lay.base) == published_bytes(lay.base)

    # the next load of a removed key is a plain miss; the good ones still load
    d = [sentinel_buf(BLOCK) for _ in keys]
    r.load("again", [(k, x, BLOCK) for k, x in zip(keys, d, strict=True)])
    c = finish(r)["again"]
    assert c.ok == [k not in bad for k in keys]
    assert r.stats.loads_miss == len(bad) and r.stats.loads_corrupt == len(bad)


@pytest.mark.parametrize("case", list(CASES))
def test_read_block_rejects_and_removes_corrupt_files(make_layout, ns, root, case):
    lay = make_layout()
    keys = [b"good-1", b"victim-1", b"good-2", b"victim-2"]
    for k in keys:
        assert lay.write_block(k, payload(k, BLOCK))
    apply, _ = CASES[case]
    apply({"lay": lay, "ns": ns, "root": root, "victim": keys[1], "victim2": keys[3],
           "path": lay.path_for(keys[1])})
    bad = {keys[1], keys[3]} if case == "swap_two_files" else {keys[1]}
    for k in keys:
        got = lay.read_block(k)
        if k in bad:
            assert got is None and not lay.exists(k)
        else:
            assert got == payload(k, BLOCK)


def test_header_padding_is_not_checked_but_harmless(make_layout, make_reactor):
    """Bytes between the header struct and the payload carry nothing: a flip there must
    not change what is loaded (the payload checksum still holds)."""
    lay = make_layout()
    r = make_reactor(lay, n_slots=3, io_depth=2)
    k = b"pad"
    assert lay.write_block(k, payload(k, BLOCK))
    _flip(lay.path_for(k), 2000)
    d = sentinel_buf(BLOCK)
    r.load("l", [(k, d, BLOCK)])
    assert finish(r)["l"].ok == [True]
    assert bytes(d) == payload(k, BLOCK)
