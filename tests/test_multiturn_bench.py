"""benchmarks/multiturn.py runs end to end on CPU (tiny model, no compile): every arm replays the whole trace, reuse
cuts the prefill work, and the rows and table are written."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import multiturn  # noqa: E402


def test_multiturn_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "multiturn.jsonl"
    argv = ["--device", "cpu", "--tiny", "--methods", "snapkv", "--conversations", "2", "--turns", "2",
            "--min-tool", "16", "--max-tool", "40", "--min-output", "2", "--max-output", "4", "--first-prompt", "8",
            "--tool-wait", "0,0.01", "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--chunk", "32",
            "--prune-lag", "1", "--kvzip-cost", "48", "--budget", "4096", "--out", str(out)]
    assert multiturn.main(argv) == 0
    header, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    cost, rows = rows[:3], rows[3:]
    assert [(r["method"], r["context"]) for r in cost] == [("vanilla", 48), ("snapkv", 48), ("kvzip", 48)]
    assert all(r["seconds"] > 0 for r in cost)
    assert header["trace"]["conversations"] == 2
    assert [(r["method"], r["arm"]) for r in rows] == [("snapkv", "none"), ("snapkv", "chain"), ("snapkv", "prune")]
    for row in rows:
        assert "error" not in row, row
        assert row["turns_done"] == 4 and not row["timed_out"]
        assert row["generated_tokens"] == rows[0]["generated_tokens"]
        assert row["options"]["budget"] == 4096
        seconds, pages = zip(*row["pages_timeline"])
        assert list(seconds) == sorted(seconds) and 0 < max(pages) <= row["peak_pages_used"]
    assert rows[0]["prefill_tokens"] == rows[0]["prompt_tokens_logical"]  # no reuse: every turn recomputed
    assert rows[1]["chain_hits"] == 2 and rows[1]["prefill_tokens"] < rows[0]["prefill_tokens"]
    assert rows[2]["prunes"] == 2 and rows[2]["prune_freed_pages"] >= 0 and rows[2]["chain_hits"] == 2
    assert "| snapkv | chain |" in capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401 - the plot is drawn when the bench extra is installed
    except ImportError:
        return
    assert (tmp_path / "multiturn.png").stat().st_size > 0
