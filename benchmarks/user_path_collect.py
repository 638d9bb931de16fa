"""One table of decode through ``generate()``: the newest row per (method, context, batch) from ``user_path.py`` runs.

    python benchmarks/user_path_collect.py FILE.jsonl [FILE.jsonl ...] [--out benchmarks/results]
    (cd benchmarks/results && python ../user_path_collect.py $(cat user_path_h200_sources.txt) --out .)

The H200 budget gives a session a few points per call, so each ``user_path.py`` call writes its own file; this
merges them. Files are read in the order given (oldest first): a later file's row for a point replaces an earlier
one, failed rows (``error``) never replace a measurement. Writes ``user_path_h200.jsonl`` (one object per point: the
fields of ``user_path.py``, with ``FIELDS`` always present, null where a run did not measure one, plus ``source``,
the file it came from), ``user_path_h200.png`` (``generate()`` against the engine step, one panel per point) and
prints a Markdown table (tok/s, ratio to the engine step).
"""

from __future__ import annotations

import argparse
import json
import os

METHODS = ("vanilla", "streamingllm", "snapkv", "pyramidkv", "h2o", "quest", "omnikv")
# every row carries these (#14's fields; null where a run did not measure one)
FIELDS = ("method", "context", "batch", "generate_tok_s", "engine_tok_s", "first_call_extra_s", "warm_process_extra_s")
POINTS = ((32768, 1), (32768, 16), (131072, 1), (131072, 4))


# measured by a process of their own (a new process against warm caches; building its programs), not by the
# decode timings of the row: carried from the newest row that has them
SEPARATE = ("warm_process_extra_s", "programs_build_s")


def collect(paths: list[str]) -> dict[tuple[str, int, int], dict]:
    """The newest successful row per (method, context, batch), in the order of ``paths``; a row without an engine
    step (``user_path.py --no-engine``) replaces only rows without one, and the :data:`SEPARATE` figures come from
    the newest row that measured them (``warm_process_source`` names its file)."""
    rows: dict[tuple[str, int, int], dict] = {}
    separate: dict[tuple[str, int, int], dict] = {}
    for path in paths:
        name = os.path.basename(path)
        with open(path) as handle:
            for line in handle:
                row = json.loads(line)
                if "method" not in row or row.get("error") or not row.get("generate_tok_s"):
                    continue
                key = (row["method"], row["context"], row["batch"])
                if any(row.get(field) is not None for field in SEPARATE):
                    separate[key] = {**{field: row.get(field) for field in SEPARATE}, "warm_process_source": name}
                if row.get("engine_tok_s") or not (rows.get(key) or {}).get("engine_tok_s"):
                    rows[key] = {**{field: None for field in FIELDS}, **row, "source": name}
    for key, figures in separate.items():
        rows[key].update(figures)
    return rows


def _label(context: int, batch: int) -> str:
    return f"{context // 1024}K x {batch}"


def markdown(rows: dict[tuple[str, int, int], dict]) -> str:
    """Methods down, points across: ``generate()`` tok/s (its ratio to the engine step of the same run)."""
    lines = ["| method | " + " | ".join(_label(*p) for p in POINTS) + " |", "|---|" + "---|" * len(POINTS)]
    for method in METHODS:
        cells = []
        for context, batch in POINTS:
            row = rows.get((method, context, batch))
            if row is None:
                cells.append("-")
                continue
            cell = f"{row['generate_tok_s']:,.1f}"
            if row.get("engine_tok_s"):
                cell += f" ({row['generate_tok_s'] / row['engine_tok_s']:.3f})"
            cells.append(cell)
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: dict[tuple[str, int, int], dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(POINTS), figsize=(4.2 * len(POINTS), 4))
    for ax, (context, batch) in zip(axes, POINTS):
        names = [m for m in METHODS if (m, context, batch) in rows]
        xs = range(len(names))
        gen = [rows[(m, context, batch)]["generate_tok_s"] for m in names]
        eng = [rows[(m, context, batch)].get("engine_tok_s") or 0.0 for m in names]
        ax.bar([x - 0.2 for x in xs], gen, width=0.4, label="generate()")
        ax.bar([x + 0.2 for x in xs], eng, width=0.4, label="engine step")
        ax.set_xticks(list(xs), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{_label(context, batch)}, Llama-3.1-8B shape, H200", fontsize=9)
        ax.set_ylabel("decode tok/s (aggregate)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="user_path.py result files, oldest first")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tag", default="_h200", help="suffix of user_path<TAG>.jsonl / .png")
    args = parser.parse_args(argv)
    target = os.path.join(args.out, f"user_path{args.tag}.jsonl")
    if any(os.path.abspath(f) == os.path.abspath(target) for f in args.files):
        parser.error(f"{target} is the output: pass the per-run files only")
    rows = collect(args.files)
    order = {m: i for i, m in enumerate(METHODS)}
    with open(target, "w") as handle:
        for key in sorted(rows, key=lambda k: (k[1], k[2], order.get(k[0], len(order)), k[0])):
            handle.write(json.dumps(rows[key]) + "\n")
    try:
        plot(rows, os.path.join(args.out, f"user_path{args.tag}.png"))
    except ImportError:
        print("(no plot: pip install -e '.[bench]' for matplotlib)")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
