"""PNG plots of plans and simulations (matplotlib's Agg canvas, no pyplot, no display needed).

matplotlib is imported inside the functions: importing :mod:`stalwart.sim` stays cheap and
selects no backend; Figure + FigureCanvasAgg touch no global matplotlib state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.errors import ConfigError
from stalwart.sim.planner import Plan, ScalePoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_ettr_vs_interval", "plot_ettr_vs_scale"]


def _out(path: Path) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create plot directory {path.parent}: {err.strerror}; pass a writable --out"
        ) from err
    return path


def _save(fig: Figure, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    try:
        fig.savefig(_out(path), dpi=120)
    except OSError as err:
        raise ConfigError(f"cannot write {path}: {err.strerror}; pass a writable --out") from err


def plot_ettr_vs_interval(plan: Plan, path: Path) -> Path:
    """ETTR against checkpoint interval, one line per strategy, optimum and Daly marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.add_subplot()
    for sp in plan.strategies:
        minutes = [g / 60.0 for g in sp.grid_s]
        (line,) = ax.plot(minutes, [100.0 * c for c in sp.curve], label=sp.strategy)
        if sp.optimum_s is not None:
            ax.axvline(sp.optimum_s / 60.0, color=line.get_color(), linestyle=":", linewidth=1)
        ax.plot(
            [sp.daly_s / 60.0],
            [100.0 * _at(sp.grid_s, sp.curve, sp.daly_s)],
            "x",
            color=line.get_color(),
        )
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of compute; x = Daly, dotted = simulated optimum)")
    ax.set_ylabel("ETTR (%)")
    ax.set_title(f"{plan.scenario}: {plan.gpus:,} GPUs, MTBF {plan.mtbf_s / 3600:.2f} h")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)
    return path


def _at(grid: tuple[float, ...], curve: tuple[float, ...], x: float) -> float:
    best = min(range(len(grid)), key=lambda i: abs(grid[i] - x))
    return curve[best]


def plot_ettr_vs_scale(points: tuple[ScalePoint, ...], name: str, path: Path) -> Path:
    """ETTR against cluster size (GPUs), one line per strategy."""
    from matplotlib.figure import Figure

    if not points:
        raise ConfigError("no cluster sizes to plot")
    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.add_subplot()
    gpus = [p.gpus for p in points]
    for strategy in points[0].ettr:
        ax.plot(gpus, [100.0 * p.ettr[strategy] for p in points], marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("ETTR (%)")
    ax.set_title(f"{name}: ETTR vs cluster size (Daly interval per size)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)
    return path
