"""PNG plots for the bench commands, drawn on an Agg canvas without pyplot (no global figure state)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float | None]  # None: no point (a figure that was not measured)
    style: str = "o-"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    log_x: bool = False
    log_y: bool = False


def check_plot_target(path: str) -> None:
    """Fail before a benchmark runs, not after: a missing plotting library or an unwritable PNG path would
    otherwise lose minutes of measurement (and the table and JSON printed with the plot)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--plot {path}: matplotlib cannot be imported ({e}); install it or drop --plot") from e
    target = Path(path).expanduser()
    if not path.lower().endswith(".png"):
        raise ValueError(f"--plot {path}: the plot is a PNG file, so its name must end in .png")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {path}: the folder {folder} is not writable")


def _figure(num_panels: int) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5 * num_panels, 4.2), dpi=90)
    FigureCanvasAgg(fig)
    return fig


def line_plot(path: str, panels: Sequence[Panel], title: str | None = None) -> None:
    """One or more side-by-side line charts in one PNG."""
    fig = _figure(len(panels))
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for s in panel.series:
            points = [(x, y) for x, y in zip(s.x, s.y) if y is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], s.style, label=s.label)
        if panel.log_x:
            from matplotlib.ticker import NullFormatter

            ax.set_xscale("log", base=2)
            ticks = sorted({x for s in panel.series for x in s.x})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_formatter(NullFormatter())
        if panel.log_y:
            ax.set_yscale("log")
        _decorate(ax, panel.title, panel.xlabel, panel.ylabel)
    _save(fig, path, title)


@dataclass(frozen=True, slots=True)
class BarPanel:
    title: str
    ylabel: str
    series: Sequence[Series]  # each series' y values in group order (its x is unused)
    fmt: str = "%.1f"  # the label printed on each bar


def bar_plot(path: str, title: str, ylabel: str, groups: Sequence[str], series: Sequence[Series]) -> None:
    """Grouped bars: one group per label in `groups`, one bar per series (its y values in group order)."""
    bar_panels(path, groups, [BarPanel("", ylabel, series)], title)


def bar_panels(path: str, groups: Sequence[str], panels: Sequence[BarPanel], title: str | None = None) -> None:
    """Side-by-side grouped bar charts over the same groups (figures in different units, one panel each)."""
    fig = _figure(len(panels))
    for p, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), p + 1)
        width = 0.8 / max(len(panel.series), 1)
        for i, s in enumerate(panel.series):
            xs = [g + (i - (len(panel.series) - 1) / 2) * width for g in range(len(groups))]
            bars = ax.bar(xs, [0.0 if y is None else y for y in s.y], width=width, label=s.label)
            ax.bar_label(bars, fmt=panel.fmt, fontsize=8)
        ax.set_xticks(range(len(groups)), list(groups))
        if len(groups) > 3:
            ax.tick_params(axis="x", labelsize=7)
        _decorate(ax, panel.title, "", panel.ylabel)
    _save(fig, path, title)


def _decorate(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Figure, path: str, title: str | None) -> None:
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
