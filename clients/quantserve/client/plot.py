"""PNG plots of a trace step and of a sweep. matplotlib (the ``client`` extra) is imported inside the functions,
with the Agg canvas and no pyplot, so importing this module costs nothing and needs no display.

Sizes are fixed, so a PNG's pixel size is predictable (figure inches x DPI, no tight bounding box):
  trace step: TRACE_SIZE_IN x DPI = 900 x 450 px;
  sweep:      one SWEEP_PANEL_IN panel per top-k value: (450 * panels) x 400 px.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from quantserve.client.types import TraceStep, trace_from_dict

DPI = 100
TRACE_SIZE_IN = (9.0, 4.5)
SWEEP_PANEL_IN = (4.5, 4.0)


def trace_png_size() -> tuple[int, int]:
    """(width, height) in pixels of :func:`plot_trace_step`'s PNG."""
    return round(TRACE_SIZE_IN[0] * DPI), round(TRACE_SIZE_IN[1] * DPI)


def sweep_png_size(panels: int) -> tuple[int, int]:
    """(width, height) in pixels of :func:`plot_sweep`'s PNG with ``panels`` top-k values."""
    return round(SWEEP_PANEL_IN[0] * panels * DPI), round(SWEEP_PANEL_IN[1] * DPI)


def _figure(size_in: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size_in, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, out: str) -> None:
    # print_png renders at the figure's own size and dpi: no tight bbox, whatever the user's matplotlibrc says.
    fig.canvas.print_png(out)


def load_trace(path: str) -> tuple[list[TraceStep], list[str], dict[str, Any]]:
    """A trace file written by ``quant-client trace --json``: (steps, chosen token texts, the whole doc)."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("trace"), list):
        raise ValueError(f"{path} is not a trace file (no 'trace' list; write one with quant-client trace --json)")
    return [trace_from_dict(t) for t in doc["trace"]], list(doc.get("tokens") or []), doc


def plot_trace_step(step: TraceStep, out: str, title: str = "") -> None:
    """Left: the probability mass (after temperature) that survives each stage, split into the listed top
    candidates and the rest of the kept tokens, annotated with the exact kept counts. Right: the listed
    candidates' probabilities after temperature, coloured by the stage that removed them (min-p, top-k and top-p
    each keep a prefix of the sorted candidates, so rank < kept_* says whether a candidate survived)."""
    fig = _figure(TRACE_SIZE_IN)
    left, right = fig.subplots(1, 2, width_ratios=(1, 1.4))
    cands = step.after_temperature
    probs = [c.prob for c in cands]
    stages = ("after temperature", "after min-p", "after top-k", "after top-p")
    kept = ("all tokens", f"{step.kept_min_p} kept", f"{step.kept_top_k} kept", f"{step.kept_top_p} kept")
    masses = (1.0, step.mass_min_p, step.mass_top_k, step.mass_top_p)
    listed = (sum(probs), sum(probs[:step.kept_min_p]), sum(probs[:step.kept_top_k]), sum(probs[:step.kept_top_p]))
    listed = tuple(min(a, m) for a, m in zip(listed, masses))
    rest = tuple(max(m - a, 0.0) for a, m in zip(listed, masses))
    x = range(len(stages))
    log = min(masses) < 0.01  # a flat distribution (e.g. an untrained model): tiny masses need a log axis
    if log:
        left.set_yscale("log")
        left.bar(x, masses, color="tab:blue", label="kept mass (log scale)")
        left.set_ylim(max(min(masses), 1e-12) / 10, 10)
    else:
        left.bar(x, listed, color="tab:blue", label=f"top {len(cands)} listed")
        left.bar(x, rest, bottom=listed, color="tab:cyan", label="other kept tokens")
        left.set_ylim(0, 1.25)
    for i in x:
        y = masses[i] * 1.15 if log else masses[i] + 0.02
        left.text(i, y, f"{masses[i]:.3g}\n{kept[i]}", ha="center", va="bottom", fontsize=8)
    left.set_xticks(list(x), stages, fontsize=8)
    left.set_ylabel("probability mass (after temperature)")
    left.set_title(f"mass kept per stage · entropy {step.entropy:.3f} nats", fontsize=9)
    left.legend(fontsize=7, loc="upper right")

    colors = ["tab:green" if r < step.kept_top_p else "tab:orange" if r < step.kept_top_k else "tab:red"
              if r < step.kept_min_p else "tab:purple" for r in range(len(cands))]
    labels = [repr(c.token)[:16] for c in cands]  # quoted: leading spaces stay visible
    ys = list(range(len(cands)))[::-1]
    right.barh(ys, probs, color=colors)
    right.set_yticks(ys, labels, fontsize=7)
    right.set_xlabel("probability after temperature")
    right.set_title("candidates: kept / removed by top-p / by top-k / by min-p", fontsize=9)
    from matplotlib.patches import Patch

    right.legend(handles=[Patch(color="tab:green", label="kept (drawn from)"),
                          Patch(color="tab:orange", label="removed by top-p"),
                          Patch(color="tab:red", label="removed by top-k"),
                          Patch(color="tab:purple", label="removed by min-p")], fontsize=7, loc="upper center",
                 bbox_to_anchor=(0.5, -0.13), ncol=4)  # below the axes: never over a bar
    if title:
        fig.suptitle(title, fontsize=10)
    _save(fig, out)


def plot_sweep(rows: Sequence[dict[str, float]], metric: str, out: str, title: str = "") -> int:
    """Heatmaps of ``metric`` over (temperature rows x top-p columns), one panel per top-k value, on one colour
    scale. Returns the number of panels (the PNG is :func:`sweep_png_size` of it)."""
    if not rows:
        raise ValueError("the sweep file has no rows")
    if metric not in rows[0]:
        raise ValueError(f"metric {metric!r} is not in the sweep file; it has: "
                         f"{', '.join(k for k in rows[0] if k not in ('temperature', 'top_k', 'top_p'))}")
    temps = sorted({r["temperature"] for r in rows})
    ps = sorted({r["top_p"] for r in rows})
    ks = sorted({r["top_k"] for r in rows})
    grid = {(r["top_k"], r["temperature"], r["top_p"]): r[metric] for r in rows}
    vals = [v for v in grid.values() if not math.isnan(v)]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    if hi == lo:  # a constant metric still gets a valid colour scale
        lo, hi = lo - 0.5, hi + 0.5
    fig = _figure((SWEEP_PANEL_IN[0] * len(ks), SWEEP_PANEL_IN[1]))
    axes = fig.subplots(1, len(ks), squeeze=False)[0]
    im = None
    for ax, k in zip(axes, ks):
        # rows: temperatures (ascending downwards), columns: top_p; NaN cells stay blank
        z = [[grid.get((k, t, p), math.nan) for p in ps] for t in temps]
        im = ax.imshow(z, vmin=lo, vmax=hi, cmap="viridis", aspect="auto")
        for i, row in enumerate(z):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=8,
                            color="white" if (v - lo) / (hi - lo) < 0.5 else "black")
        ax.set_xticks(range(len(ps)), [f"{p:g}" for p in ps], fontsize=8)
        ax.set_yticks(range(len(temps)), [f"{t:g}" for t in temps], fontsize=8)
        ax.set_xlabel("top_p")
        ax.set_ylabel("temperature")
        ax.set_title(f"top_k = {int(k)}" + (" (off)" if k == 0 else ""), fontsize=9)
    fig.colorbar(im, ax=list(axes), shrink=0.8, label=metric)
    fig.suptitle(title or metric, fontsize=10)
    _save(fig, out)
    return len(ks)
