"""benchmarks/serving.py runs end to end on CPU (tiny model, no compile) and writes its rows and table."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import serving  # noqa: E402


def test_serving_benchmark_smoke(tmp_path):
    argv = ["--device", "cpu", "--tiny", "--methods", "vanilla,snapkv", "--num-requests", "4", "--min-prompt", "16",
            "--max-prompt", "64", "--min-output", "4", "--max-output", "8", "--hf-batch", "2", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64", "--chunk", "32", "--tag", "_smoke", "--out", str(tmp_path)]
    assert serving.main(argv) == 0
    header, *rows = [json.loads(line) for line in (tmp_path / "serving_smoke.jsonl").read_text().splitlines()]
    assert header["workload"]["num_requests"] == 4
    assert [(r["system"], r["method"]) for r in rows] == [
        ("sparsecompile", "vanilla"), ("sparsecompile", "snapkv"), ("hf-dynamic", "vanilla")]
    for row in rows:
        assert "error" not in row, row
        assert row["exact_lengths"] and row["workload"] == header["workload"]
        assert row["output_tok_s"] > 0 and row["e2e_p99_s"] <= row["wall_s"] + 1e-3
    assert all(r["generated_tokens"] == header["output_tokens"] for r in rows[:2])
    assert rows[2]["useful_tokens"] == header["output_tokens"] <= rows[2]["generated_tokens"]
    table = (tmp_path / "serving_smoke.md").read_text()
    assert table.count("| sparsecompile |") == 2 and "| hf-dynamic |" in table


def test_serving_burst_benchmark_smoke(tmp_path):
    import serving_burst

    argv = ["--device", "cpu", "--tiny", "--running", "2", "--burst", "4", "--prompt", "48", "--budget", "128",
            "--steady-steps", "4", "--while-decoding", "16", "--out", str(tmp_path), "--tag", "_smoke",
            "--modes", "per_chunk,mixed,capped_separate"]
    assert serving_burst.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "serving_burst_smoke.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["per_chunk", "mixed", "capped_separate"]
    assert [r["max_prefill_tokens_while_decoding"] for r in rows] == [None, None, 16]
    assert [r["enable_mixed_chunk"] for r in rows] == [False, True, False]
    assert all(r["burst_p99_ms"] >= r["burst_p50_ms"] > 0 and r["steady_p50_ms"] > 0 for r in rows)


def test_step_ops_counts_a_mixed_steps_ops_by_source(tmp_path, capsys):
    import step_ops

    out = tmp_path / "step_ops.jsonl"
    assert step_ops.main(["--device", "cpu", "--layers", "2", "--chunk", "16", "--running", "2", "--steps", "2",
                          "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["ops"] >= sum(row["by_source"].values()) > 0  # by_source: the 12 largest sources
    assert any(source.startswith("slot_access.py") for source in row["by_source"])  # the attention path ran
    assert row["mixed_step_ms"] > 0 and "ops per mixed step" in capsys.readouterr().out
