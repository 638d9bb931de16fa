"""Pages in use over time, one line per (method, arm), from ``benchmarks/multiturn.py`` rows."""

from __future__ import annotations

from typing import Any


def plot_pages(rows: list[dict[str, Any]], path: str, header: dict[str, Any]) -> None:
    """KV pages in use (in GiB where the row says the page size) against seconds since the arm started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [r for r in rows if r.get("pages_timeline")]
    if not lines:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in lines:
        t, pages = zip(*r["pages_timeline"])
        per_page = r["peak_GiB_used"] / r["peak_pages_used"] if r.get("peak_pages_used") else None
        y = [n * per_page for n in pages] if per_page else pages
        budget = r.get("options", {}).get("budget")
        label = f"{r['method']} {r['arm']}" + (f" (budget {budget})" if budget else "") + f": {r['wall_s']:.1f} s"
        ax.plot(t, y, label=label, linewidth=1.2)
    ax.set_xlabel("seconds since the arm started")
    ax.set_ylabel("KV GiB in use" if all(r.get("peak_pages_used") for r in lines) else "KV pages in use")
    ax.set_title(f"multi-turn trace, {header['model']} on {header['gpu']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
