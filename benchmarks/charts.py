"""PNG charts of the benchmarks' comparisons (``--chart FILE.png``), drawn with matplotlib.

matplotlib is imported only when a chart is drawn, on the Agg backend (no display needed), so every benchmark
runs without it; ``pip install -e '.[bench]'`` installs it.  Two shapes cover the comparisons:

- :func:`bandwidth`: bus bandwidth against message size, one line per implementation, one panel per collective
  and world size;
- :func:`bars`: grouped bars (training throughput per model and side, latency per pattern and implementation,
  seconds per variant).

Every chart carries a footnote (``note``): where and when it was measured, and the machine's load then.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, Sequence, Tuple

# panel title -> implementation -> [(size in bytes, value)]
Panels = Mapping[str, Mapping[str, Sequence[Tuple[int, float]]]]

DPI = 80
PANEL_W, PANEL_H = 4.2, 3.0


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--chart needs matplotlib, which is not installed; `pip install matplotlib` "
                         "(or `pip install -e '.[bench]'`), or leave --chart out") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(names: Sequence[str]) -> Dict[str, object]:
    """The same colour for an implementation in every panel of a figure."""
    plt = _pyplot()
    cycle = plt.get_cmap("tab10")
    return {name: cycle(i % 10) for i, name in enumerate(names)}


def _size_label(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def _finish(fig, path: str, title: str, note: str) -> str:
    if title:
        fig.suptitle(title, fontsize=10, y=0.99)
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 0.94 if title else 1), h_pad=0.6)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # "tight": the legends sit outside the axes
    _pyplot().close(fig)
    return path


def bandwidth(panels: Panels, path: str, title: str = "", note: str = "",
              ylabel: str = "bus bandwidth (GB/s)", ncols: int = 2, log_y: bool = True) -> str:
    """One log-size panel per entry of ``panels``, a line per implementation; writes ``path`` and returns it.

    ``log_y``: bandwidth spans three orders of magnitude from 4 KiB to 64 MiB; a linear axis hides the small sizes.
    """
    if not panels:
        raise ValueError("nothing to chart: no panel has any measured point")
    plt = _pyplot()
    names: List[str] = []
    for series in panels.values():
        names += [n for n in series if n not in names]
    colors = _colors(names)
    ncols = max(1, min(ncols, len(panels)))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_W * ncols, PANEL_H * nrows + 0.6), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels.items()):
        sizes = sorted({s for points in series.values() for s, _ in points})
        for name in names:
            points = sorted(series.get(name, ()))
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, linewidth=1.2,
                        color=colors[name], label=name)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([_size_label(s) for s in sizes], fontsize=7)
        ax.minorticks_off()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(panel, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors[n], marker="o", markersize=3, label=n) for n in names]
    # outside the panels (right of the first row): with many implementations a legend inside hides the lines
    axes[0, -1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    return _finish(fig, path, title, note)


def bars(groups: Mapping[str, Mapping[str, float]], path: str, title: str = "", note: str = "",
         ylabel: str = "", log: bool = False) -> str:
    """Grouped bars: one group per key of ``groups`` (a model, a pattern), one bar per series inside it."""
    if not groups:
        raise ValueError("nothing to chart: no group has any measured value")
    plt = _pyplot()
    names: List[str] = []
    for series in groups.values():
        names += [n for n in series if n not in names]
    colors = _colors(names)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(min(8.0, 2.0 + 0.35 * len(groups) * len(names)), 3.2))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g, series in enumerate(groups.values()) if name in series]
        ys = [series[name] for series in groups.values() if name in series]
        ax.bar(xs, ys, width=width, color=colors[name], label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups), fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _finish(fig, path, title, note)


def throughput(results: Mapping[str, Mapping[str, Mapping[str, float]]], labels: Mapping[str, str], path: str,
               title: str = "", note: str = "") -> str:
    """Training throughput: ``results[model][side]["samples_per_sec"]`` as bars per model, sides named by
    ``labels`` (sides missing there, or without a rate because they failed, are left out)."""
    groups = {model: {labels[side]: r["samples_per_sec"] for side, r in sides.items()
                      if side in labels and "samples_per_sec" in r} for model, sides in results.items()}
    return bars(groups, path, title=title, note=note, ylabel="samples/s (all ranks)")


def sibling(path: str, suffix: str) -> str:
    """``out/chart.png`` + ``latency`` -> ``out/chart-latency.png`` (a second chart of the same run)."""
    root, ext = os.path.splitext(path)
    return f"{root}-{suffix}{ext or '.png'}"
