"""Kill -9 torn-file trial, 30 trials (scripts/reliability_kill9.py runs 1,000): a writer
publishing blocks (with eviction) is SIGKILLed at a random moment; every file under a
final name is complete and valid (``check_block`` with verify), and the next process that
opens the layout collects every temp file the dead writer left and resyncs the ledger."""

from __future__ import annotations

from helpers.kvutil import load_script


def test_kill9_leaves_no_torn_file_and_temps_are_collected(tmp_path):
    s = load_script("reliability_kill9").run(30, seed=7, workdir=str(tmp_path))
    assert s["failures"] == [], s["failures"][:3]
    assert s["torn_files_visible"] == 0
    assert s["final_files_checked"] > 0
    assert s["temp_files_collected"] == s["temp_files_left_by_kill"]
    assert s["temp_files_left_after_reopen"] == 0
    assert s["ledger_exact_after_reopen"] == 30
    assert s["trials_rename"] > 0
