"""benchmarks/user_path_collect.py merges user_path.py runs: the newest measurement per point wins, a failed row
never replaces one, and the output file is never one of the inputs."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import user_path_collect  # noqa: E402


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_newest_row_per_point_wins_and_errors_do_not(tmp_path, capsys):
    old = _write(tmp_path / "a.jsonl", [
        {"method": "snapkv", "context": 32768, "batch": 1, "generate_tok_s": 190.0, "engine_tok_s": 200.0},
        {"method": "h2o", "context": 32768, "batch": 1, "generate_tok_s": 170.0},
    ])
    new = _write(tmp_path / "b.jsonl", [
        {"bandwidth": {}},  # a header line without a method is skipped
        {"method": "snapkv", "context": 32768, "batch": 1, "generate_tok_s": 198.0, "engine_tok_s": 200.0},
        {"method": "h2o", "context": 32768, "batch": 1, "error": "out of memory"},
        {"method": "quest", "context": 131072, "batch": 4, "generate_tok_s": 469.2, "engine_tok_s": 479.5},
    ])
    assert user_path_collect.main([old, new, "--out", str(tmp_path), "--tag", "_t"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "user_path_t.jsonl").read_text().splitlines()]
    assert all(set(user_path_collect.FIELDS) <= set(r) for r in rows)  # null where a run did not measure one
    got = {(r["method"], r["context"], r["batch"]): (r["generate_tok_s"], r["source"]) for r in rows}
    assert got == {("snapkv", 32768, 1): (198.0, "b.jsonl"), ("h2o", 32768, 1): (170.0, "a.jsonl"),
                   ("quest", 131072, 4): (469.2, "b.jsonl")}
    table = capsys.readouterr().out
    assert "| `snapkv` | 198.0 (0.990) |" in table and "| `h2o` | 170.0 | - |" in table
    assert "469.2 (0.979)" in table


def test_warm_process_figures_carry_and_rows_without_engine_do_not_replace(tmp_path):
    """A programs run (``--no-engine --warm-process``) gives its warm-process figure to the point's row but does not
    replace the generate / engine pair measured in one run."""
    pair = {"method": "quest", "context": 32768, "batch": 1, "generate_tok_s": 164.3, "engine_tok_s": 168.9}
    first = _write(tmp_path / "a.jsonl", [pair, {**pair, "method": "snapkv", "warm_process_extra_s": 9.1}])
    later = _write(tmp_path / "b.jsonl", [
        {"method": "quest", "context": 32768, "batch": 1, "generate_tok_s": 160.0, "warm_process_extra_s": 0.3,
         "programs_build_s": 120.0},
        {"method": "vanilla", "context": 32768, "batch": 1, "generate_tok_s": 166.0},  # nothing to keep: taken
        {**pair, "method": "snapkv", "generate_tok_s": 170.0},  # newer pair, no warm figure: the old one stays
    ])
    rows = user_path_collect.collect([first, later])
    quest = rows[("quest", 32768, 1)]
    assert (quest["generate_tok_s"], quest["engine_tok_s"], quest["source"]) == (164.3, 168.9, "a.jsonl")
    assert (quest["warm_process_extra_s"], quest["programs_build_s"], quest["warm_process_source"]) == (
        0.3, 120.0, "b.jsonl")
    assert rows[("vanilla", 32768, 1)]["generate_tok_s"] == 166.0
    snapkv = rows[("snapkv", 32768, 1)]
    assert (snapkv["generate_tok_s"], snapkv["warm_process_extra_s"], snapkv["warm_process_source"]) == (
        170.0, 9.1, "a.jsonl")


def test_output_is_not_an_input(tmp_path):
    out = _write(tmp_path / "user_path_t.jsonl", [])
    with pytest.raises(SystemExit):
        user_path_collect.main([out, "--out", str(tmp_path), "--tag", "_t"])
