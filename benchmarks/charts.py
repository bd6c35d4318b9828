"""PNG line charts for the benchmarks whose figures are curves (per turn, per concurrency).

One implementation for every benchmark: a title, two axis labels and named series of (x, y)
points. matplotlib's Agg backend needs no display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

Series = Mapping[str, Sequence[tuple[float, float]]]


def line_chart(path: str | Path, title: str, xlabel: str, ylabel: str, series: Series) -> Path:
    """Write `series` as one line each (with markers) to the PNG at `path`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, points in series.items():
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
