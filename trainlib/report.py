"""Pictures of training runs:

    python -m trainlib.report RUN_DIR [RUN_DIR ...] [--out PREFIX]

writes PREFIX.png (needs matplotlib: `pip install 'trainlib[report]'`; without
it the PNG is skipped with a note) and PREFIX.html, one self-contained page of
inline SVG that opens offline. The default PREFIX is `report` inside the first
RUN_DIR. Each panel plots a metrics.jsonl field against the step, runs
overlaid in one color each: loss (with val_loss where validation ran), lr,
grad_norm, tokens_per_second and peak_memory_gib. Legends name each run by
its folder, plus the recipe keys in which the runs' config.toml differ.
Mixture-of-Experts runs add moe_aux_loss, moe_z_loss and the dropped tokens
(where non-zero), and one heat map per run of each MoE layer's load
imbalance over the steps; the summary table gains the last logged step's
mean and max imbalance over the layers.
Fault-tolerant runs (one run folder per replica group, `<dump_folder>/replica_<g>`)
add the live replica groups per step (`ft_participants`) with each heal marked
(`ft_heal_s`: a group that rejoined and received a live peer's state), and the
table lists the heal events.
A resumed run appends to metrics.jsonl, so a step may appear twice: the later
record wins. `plot_parity` draws a `trainlib.parity` report the same way.
"""

from __future__ import annotations

import argparse
import html
import importlib
import json
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from trainlib.config.loader import load_toml_with_extends

# matplotlib's default cycle, so the PNG and the page color runs alike.
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
PARITY_FLOOR = 1e-9  # where an exactly equal step sits on the log axis of relative deviations
# Light to dark, as matplotlib's "YlOrRd" (ColorBrewer's stops): a sequential scale, so darker is always more
# imbalanced and the page reads like the PNG.
HEAT_CMAP = "YlOrRd"
HEAT_STOPS = [(255, 255, 204), (254, 178, 76), (240, 59, 32), (128, 0, 38)]
# A heat map panel is ~400 px wide: more columns than this are under 2 px each and only grow the page
# (a long run logs 10^4 steps x ~100 layers), so neighbouring steps are averaged into one column.
MAX_HEAT_COLUMNS = 240


@dataclass
class Series:
    label: str
    color: str
    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    dashed: bool = False
    markers: bool = False
    width: float = 1.5


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series]
    logy: bool = False


@dataclass
class HeatMap:
    """A value per (row, column) cell: rows are MoE layers (bottom up), columns are runs of logged steps."""
    title: str
    label: str  # the run's
    rows: list[str]  # the layer indices, the y tick labels
    edges: list[float]  # column boundaries on the step axis, len(columns) + 1: steps need not be evenly spaced
    spans: list[tuple[int, int]]  # each column's first and last step (the same step when not averaged)
    values: list[list[float | None]]  # values[row][column]; None where no finite value was logged
    zlabel: str = ""


@dataclass
class Run:
    name: str
    records: list[dict]  # one per step, by step
    config: dict  # config.toml flattened to {"section.key": value}; {} when absent


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"no metrics.jsonl in {run_dir}; pass run folders (a recipe's job.dump_folder)")
    by_step = {}
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):  # every complete record ends with a newline
                print(f"trainlib.report: {path}:{i}: skipped a torn last record ({len(line)} bytes cut mid-write)",
                      file=sys.stderr)
                break
            # a torn record a relaunch appended its first one to (trainlib now drops such a tail on resume)
            start = line.find('{"step"', 1)
            try:
                record = json.loads(line[start:]) if start > 0 else None
            except json.JSONDecodeError:
                record = None
            if record is None:
                raise ValueError(f"{path}:{i} is not a JSON record ({e}); fix or delete that line") from None
            print(f"trainlib.report: {path}:{i}: skipped a torn record ({start} bytes cut mid-write) before step "
                  f"{record.get('step')}'s", file=sys.stderr)
        by_step[record["step"]] = record  # a resumed run appends: the later record of a step wins
    if not by_step:
        raise ValueError(f"{path} holds no records yet; the run logs its first one after step 1")
    config = {}
    if (run_dir / "config.toml").is_file():
        config = _flatten(load_toml_with_extends(run_dir / "config.toml"))
    return Run(run_dir.resolve().name or str(run_dir), [by_step[s] for s in sorted(by_step)], config)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _finite(steps, values) -> tuple[list, list]:
    pairs = [(s, v) for s, v in zip(steps, values) if isinstance(v, (int, float)) and math.isfinite(v)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _field(run: Run, key: str) -> tuple[list, list]:
    return _finite([r["step"] for r in run.records if key in r], [r[key] for r in run.records if key in r])


def _num(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _per_layer(run: Run, key: str) -> tuple[list, list[dict]]:
    """The steps that logged `key` as {layer index: value} (MoE fields, log steps only) and those dicts."""
    logged = [(r["step"], r[key]) for r in run.records if isinstance(r.get(key), dict) and r[key]]
    return [s for s, _ in logged], [d for _, d in logged]


def _dropped(run: Run) -> tuple[list, list]:
    steps, per_layer = _per_layer(run, "moe_dropped_tokens")
    return steps, [sum(v for v in d.values() if _num(v)) for d in per_layer]


def run_labels(runs: list[Run]) -> list[str]:
    """Each run's name plus the recipe keys whose values differ between the runs
    (among the runs that have a config.toml)."""
    configs = [r.config for r in runs if r.config]
    keys = sorted(set.intersection(*map(set, configs)) - {"job.dump_folder"}) if configs else []
    differ = [k for k in keys if len({repr(c[k]) for c in configs}) > 1]
    labels = []
    for r in runs:
        shown = [f"{k}={r.config[k]}" for k in differ if k in r.config]
        more = f", +{len(shown) - 3} more" if len(shown) > 3 else ""
        labels.append(r.name + (f" ({', '.join(shown[:3])}{more})" if shown else ""))
    return labels


def _loss_change(run: Run) -> str:
    steps, losses = _field(run, "loss")
    return f"{_fmt(losses[0])} -> {_fmt(losses[-1])} at step {steps[-1]}" if losses else "none logged"


def training_panels(runs: list[Run]) -> tuple[list[Panel | HeatMap], list[Series]]:
    """The report's panels and its legend (one entry per run, then line styles)."""
    colors = [COLORS[i % len(COLORS)] for i in range(len(runs))]
    loss = []
    for run, color in zip(runs, colors):
        loss.append(Series(f"{run.name} loss", color, *_field(run, "loss")))
        val = Series(f"{run.name} val_loss", color, *_field(run, "val_loss"), dashed=True, markers=True)
        if val.steps:
            loss.append(val)
    has_val = any(s.dashed for s in loss)
    panels = [Panel("loss (dashed: validation)" if has_val else "training loss", "loss", loss)]
    for title, key, ylabel in [("learning rate", "lr", "lr"), ("gradient norm", "grad_norm", "grad_norm"),
                               ("throughput", "tokens_per_second", "tokens/s (global)"),
                               ("peak memory", "peak_memory_gib", "peak memory (GiB)")]:
        panels.append(Panel(title, ylabel, [Series(run.name, c, *_field(run, key)) for run, c in zip(runs, colors)]))
    labels = run_labels(runs)
    panels += moe_panels(runs, labels, colors)
    panels += ft_panels(runs, colors)
    legend = [Series(f"{label}: loss {_loss_change(run)}", c, width=2.5)
              for run, label, c in zip(runs, labels, colors)]
    if has_val:
        legend += [Series("training loss", "#444444"), Series("validation loss", "#444444", dashed=True, markers=True)]
    return panels, legend


def moe_panels(runs: list[Run], labels: list[str], colors: list[str]) -> list[Panel | HeatMap]:
    """Mixture-of-Experts routing, [] for dense runs: the auxiliary losses and the dropped tokens, each
    only where some run's is non-zero (a z-loss weight of 0 or no capacity limit logs zeros that say
    nothing), then one expert-load heat map per run that logged it."""
    panels = []
    for title, ylabel, values in [("MoE load-balancing loss", "moe_aux_loss", lambda r: _field(r, "moe_aux_loss")),
                                  ("MoE router z-loss", "moe_z_loss", lambda r: _field(r, "moe_z_loss")),
                                  ("MoE dropped tokens (sum over layers)", "tokens over capacity", _dropped)]:
        series = [Series(run.name, c, *values(run)) for run, c in zip(runs, colors)]
        if any(v != 0 for s in series for v in s.values):
            panels.append(Panel(title, ylabel, series))
    for run, label in zip(runs, labels):
        steps, per_layer = _per_layer(run, "moe_load_imbalance")
        if steps:
            panels.append(heat_map("MoE load imbalance (max/mean tokens per expert)", label, steps, per_layer,
                                   zlabel="max / mean (1 = balanced)"))
    return panels


def heal_events(run: Run) -> list[tuple[int, float]]:
    """(step, seconds) of each heal a fault-tolerant run logged: the record's ft_heal_s covers the heals since
    the previous logged step."""
    return [(r["step"], r["ft_heal_s"]) for r in run.records if _num(r.get("ft_heal_s")) and r["ft_heal_s"] > 0]


def ft_panels(runs: list[Run], colors: list[str]) -> list[Panel]:
    """Fault tolerance, [] for runs without it: the live replica groups per step, heals as markers on top."""
    series = []
    for run, c in zip(runs, colors):
        steps, live = _field(run, "ft_participants")
        if steps:
            series.append(Series(run.name, c, steps, live))
            heals = heal_events(run)
            if heals:
                at = {s: v for s, v in zip(steps, live)}
                series.append(Series(f"{run.name} heals", c, [s for s, _ in heals], [at[s] for s, _ in heals],
                                     markers=True, width=0.0))
    return [Panel("fault tolerance: live replica groups (markers: heals)", "ft_participants", series)] if series else []


def heat_map(title: str, label: str, steps: list, per_step: list[dict], zlabel: str = "",
             max_columns: int = MAX_HEAT_COLUMNS) -> HeatMap:
    """Rows: the keys of `per_step`'s dicts (layer indices); columns: the steps, consecutive steps averaged
    into one column where there are more than `max_columns`."""
    # Layer indices are decimal strings: shorter first puts "10" after "9".
    rows = sorted({k for d in per_step for k in d}, key=lambda k: (len(k), k))
    # Each step's cell reaches halfway to its neighbours: uneven log steps (a resumed run) keep their place.
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    first = steps[0] - (mids[0] - steps[0] if mids else 0.5)
    edges = [first, *mids, steps[-1] + (steps[-1] - mids[-1] if mids else 0.5)]
    per = math.ceil(len(steps) / max_columns)
    starts = range(0, len(steps), per)
    values = []
    for k in rows:
        row = []
        for i in starts:
            got = [d[k] for d in per_step[i:i + per] if _num(d.get(k))]
            row.append(sum(got) / len(got) if got else None)
        values.append(row)
    return HeatMap(title, label, rows, [edges[i] for i in starts] + [edges[-1]],
                   [(steps[i], steps[min(i + per, len(steps)) - 1]) for i in starts], values, zlabel)


def parity_panels(report, tol: float) -> tuple[list[Panel], list[Series]]:
    """`report`: a trainlib.parity.ParityReport (baseline and runs with .name and .losses)."""
    base = report.baseline
    steps = list(range(1, len(base.losses) + 1))
    colors = [COLORS[i % len(COLORS)] for i in range(len(report.runs))]
    curves = [Series(base.name, "#000000", steps, list(base.losses), width=3.0)]
    devs = [Series("tolerance", "#888888", [steps[0], steps[-1]], [tol, tol], dashed=True)]
    for run, color in zip(report.runs, colors):
        n = min(len(run.losses), len(base.losses))
        curves.append(Series(run.name, color, steps[:n], list(run.losses[:n]), dashed=True, markers=True))
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run.losses, base.losses)]
        devs.append(Series(run.name, color, *_finite(steps[:n], [max(d, PARITY_FLOOR) for d in rel]),
                           dashed=True, markers=True))
    panels = [Panel(f"loss: each layout against {base.name}", "loss", curves),
              Panel("relative loss deviation per step", f"|loss - {base.name}| / {base.name} (0 drawn at "
                    f"{PARITY_FLOOR:.0e})", devs, logy=True)]
    legend = [Series(f"{base.name} (baseline)", "#000000", width=3.0)]
    legend += [Series(f"{r.name} (max {r.max_rel_loss:.1e})", c, dashed=True, markers=True)
               for r, c in zip(report.runs, colors)]
    return panels, legend + [Series(f"tolerance {tol:.0e}", "#888888", dashed=True)]


# ------------------------------------------------------------------------ PNG
def figure(panels: list[Panel | HeatMap], legend: list[Series], title: str):
    """A matplotlib Figure: the panels in rows of three, the legend in the next cell."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    rows = math.ceil((len(panels) + 1) / 3)
    # 4.5 in a row: whole pixels at 100 dpi (4.6 x 2 x 100 is 919.99... in binary
    # floating point, which matplotlib 3.10 floors to 919 rows and 3.11 rounds to 920)
    fig = Figure(figsize=(16, 4.5 * rows), dpi=100, layout="constrained")
    fig.suptitle(title, fontsize=13)
    axes = list(fig.subplots(rows, 3, squeeze=False).flat)
    for ax, panel in zip(axes, panels):
        if isinstance(panel, HeatMap):
            _draw_heat_map(fig, ax, panel)
            continue
        for s in panel.series:
            ax.plot(s.steps, s.values, color=s.color, lw=s.width, ls="--" if s.dashed else "-",
                    marker="o" if s.markers else None, ms=3.5, label=s.label)
        ax.set(title=panel.title, xlabel="step", ylabel=panel.ylabel, yscale="log" if panel.logy else "linear")
        ax.grid(alpha=0.3)
    key = axes[len(panels)]
    for s in legend:
        key.plot([], [], color=s.color, lw=s.width, ls="--" if s.dashed else "-", marker="o" if s.markers else None,
                 label=textwrap.fill(s.label, 60, subsequent_indent="  "))  # a long label must not squeeze the panels
    key.axis("off")
    key.legend(loc="upper left", frameon=False, fontsize=10)
    for ax in axes[len(panels) + 1:]:
        ax.axis("off")
    return fig


def _row_ticks(n: int, most: int = 12) -> range:
    """Which rows get a label: every one up to `most`, then evenly thinned (94 layers would overlap)."""
    return range(0, n, math.ceil(n / most))


def _draw_heat_map(fig, ax, hm: HeatMap) -> None:
    import numpy as np  # matplotlib's own dependency

    values = np.ma.masked_invalid(np.array([[math.nan if v is None else v for v in row] for row in hm.values]))
    ax.set(title=f"{hm.title}\n{textwrap.shorten(hm.label, 70)}", xlabel="step", ylabel="MoE layer")
    ticks = _row_ticks(len(hm.rows))
    ax.set_yticks([i + 0.5 for i in ticks], [hm.rows[i] for i in ticks])
    if values.count() == 0:  # nothing finite: a colour bar of an empty range would fail
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    # pcolormesh, not imshow: columns as wide as their steps, row r from r to r + 1
    mesh = ax.pcolormesh(hm.edges, range(len(hm.rows) + 1), values, cmap=HEAT_CMAP)
    fig.colorbar(mesh, ax=ax, label=hm.zlabel)


# ----------------------------------------------------------------------- HTML
def _fmt(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    return f"{v:.1e}" if 0 < a < 1e-2 else f"{v:.4g}"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _span(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def svg_panel(panel: Panel, w: int = 470, h: int = 300) -> str:
    left, right, top, bottom = 66, 12, 26, 42
    pw, ph = w - left - right, h - top - bottom
    ys_of = (lambda v: math.log10(v)) if panel.logy else (lambda v: v)
    data = [(s, s.steps, [ys_of(v) for v in s.values]) for s in panel.series
            if (s.steps and (not panel.logy or min(s.values) > 0))]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="11"><text x="{w / 2}" y="16" text-anchor="middle" font-size="13">'
           f'{html.escape(panel.title)}</text>',
           f'<text x="{left + pw / 2}" y="{h - 6}" text-anchor="middle">step</text>',
           f'<text transform="translate(13,{top + ph / 2}) rotate(-90)" text-anchor="middle">'
           f'{html.escape(panel.ylabel)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    if not data:
        return "".join(out) + f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle">no data</text></svg>'
    x0, x1 = _span([x for _, xs, _ in data for x in xs])
    y0, y1 = _span([y for _, _, ys in data for y in ys])
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: top + (y1 - y) / (y1 - y0) * ph  # noqa: E731
    for x in _ticks(x0, x1):
        out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{sx(x):.1f}" y="{top + ph + 14}" text-anchor="middle">{_fmt(x)}</text>')
    decades = range(math.ceil(y0), math.floor(y1) + 1) if panel.logy else []
    for y in decades if len(decades) > 1 else _ticks(y0, y1):
        label = f"1e{y}" if len(decades) > 1 else f"{10 ** y:.1e}" if panel.logy else _fmt(y)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{label}</text>')
    for s, xs, ys in data:
        points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
        dash = ' stroke-dasharray="6,4"' if s.dashed else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{s.color}" stroke-width="{s.width}"{dash}>'
                   f'<title>{html.escape(s.label)}</title></polyline>')
        if s.markers:
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{s.color}"><title>'
                    f'{html.escape(s.label)}, step {x:g}: {v:.6g}</title></circle>'
                    for x, y, v in zip(xs, ys, s.values)]
    return "".join(out) + "</svg>"


def _heat_color(t: float) -> str:
    """t in [0, 1] as a colour of HEAT_STOPS, linearly between neighbouring stops."""
    t = min(max(t, 0.0), 1.0) * (len(HEAT_STOPS) - 1)
    i = min(int(t), len(HEAT_STOPS) - 2)
    f = t - i
    return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(HEAT_STOPS[i], HEAT_STOPS[i + 1]))


def svg_heat_map(hm: HeatMap, w: int = 470, h: int = 300) -> str:
    """One <rect> per cell, its value in its <title>; the colour key at the right, min at the bottom."""
    left, right, top, bottom = 66, 70, 40, 42
    pw, ph = w - left - right, h - top - bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="11"><text x="{w / 2}" y="16" text-anchor="middle" font-size="13">'
           f'{html.escape(hm.title)}</text>',
           f'<text x="{w / 2}" y="31" text-anchor="middle">{html.escape(textwrap.shorten(hm.label, 70))}</text>',
           f'<text x="{left + pw / 2}" y="{h - 6}" text-anchor="middle">step</text>',
           f'<text transform="translate(13,{top + ph / 2}) rotate(-90)" text-anchor="middle">MoE layer</text>']
    cells = [v for row in hm.values for v in row if v is not None]
    frame = f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>'
    if not cells:
        return "".join(out) + frame + (f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle">no data'
                                       "</text></svg>")
    lo, hi = min(cells), max(cells)
    x0, x1 = hm.edges[0], hm.edges[-1]
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw  # noqa: E731
    rh = ph / len(hm.rows)
    row_y = lambda r: top + ph - (r + 1) * rh  # noqa: E731  (the first layer at the bottom, as in the PNG)
    for r, layer in enumerate(hm.rows):
        for c, v in enumerate(hm.values[r]):
            if v is None:
                continue
            a, b = hm.spans[c]
            at = f"step {a}" if a == b else f"steps {a}-{b} (mean)"
            xa, xb = sx(hm.edges[c]), sx(hm.edges[c + 1])
            color = _heat_color((v - lo) / (hi - lo) if hi > lo else 0.0)
            out.append(f'<rect x="{xa:.2f}" y="{row_y(r):.2f}" width="{xb - xa:.2f}" height="{rh:.2f}" fill="{color}">'
                       f'<title>layer {html.escape(layer)}, {at}: {v:.4g}</title></rect>')
    out.append(frame)
    for x in _ticks(x0, x1):
        out.append(f'<text x="{sx(x):.1f}" y="{top + ph + 14}" text-anchor="middle">{_fmt(x)}</text>')
    for r in _row_ticks(len(hm.rows)):
        out.append(f'<text x="{left - 4}" y="{row_y(r) + rh / 2 + 4:.1f}" text-anchor="end">'
                   f"{html.escape(hm.rows[r])}</text>")
    # the key: a column of swatches from the lowest value (bottom) to the highest (top), both written out
    kx, n = left + pw + 10, 10
    out += [f'<rect x="{kx}" y="{top + ph - (i + 1) * ph / n:.2f}" width="12" height="{ph / n:.2f}" '
            f'fill="{_heat_color(i / (n - 1))}"/>' for i in range(n)]
    out.append(f'<text x="{kx + 16}" y="{top + 9}">{_fmt(hi)}</text>'
               f'<text x="{kx + 16}" y="{top + ph}">{_fmt(lo)}</text>'
               f'<text x="{kx + 16}" y="{top + 24}" font-size="9">max</text>'
               f'<text x="{kx + 16}" y="{top + ph - 13}" font-size="9">min</text>')
    return "".join(out) + "</svg>"


def html_page(panels: list[Panel | HeatMap], legend: list[Series], title: str, table: list[list[str]]) -> str:
    keys = "".join(f'<li><span style="border-top:3px {"dashed" if s.dashed else "solid"} {s.color}"></span>'
                   f"{html.escape(s.label)}</li>" for s in legend)
    head, *rows = table
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
ul {{ list-style: none; padding: 0; }} li {{ margin: 0.2em 0; }}
li span {{ display: inline-block; width: 2.2em; margin-right: 0.6em; vertical-align: middle; }}
.panels {{ display: flex; flex-wrap: wrap; gap: 0.8em; }}
table {{ border-collapse: collapse; margin-top: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{keys}</ul>
<div class="panels">{"".join(svg_heat_map(p) if isinstance(p, HeatMap) else svg_panel(p) for p in panels)}</div>
<table><tr>{"".join(f"<th>{html.escape(c)}</th>" for c in head)}</tr>{cells}</table>
</body></html>
"""


# ---------------------------------------------------------------------- write
def write(panels: list[Panel | HeatMap], legend: list[Series], title: str, table: list[list[str]],
          prefix: str | Path) -> list[Path]:
    """PREFIX.html always; PREFIX.png when matplotlib is installed. Returns what was written."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = [prefix.with_name(prefix.name + ".html")]
    written[0].write_text(html_page(panels, legend, title, table), encoding="utf-8")
    try:
        importlib.import_module("matplotlib")  # only whether it imports: figure() imports what it draws with
    except ImportError:
        print(f"skipped {prefix.name}.png: matplotlib is not installed (pip install 'trainlib[report]')")
        return written
    png = prefix.with_name(prefix.name + ".png")
    figure(panels, legend, title).savefig(png)
    return written + [png]


def _summary(run: Run, moe: bool = False) -> list[str]:
    """The run's row of the table; `moe`: with the MoE columns (some run of the table logged them)."""
    def last(key):
        values = _field(run, key)[1]
        return _fmt(values[-1]) if values else "-"

    losses = _field(run, "loss")[1]
    tps = sorted(_field(run, "tokens_per_second")[1])
    return [run.name, str(run.records[-1]["step"]), _fmt(losses[0]) if losses else "-", last("loss"),
            _fmt(min(losses)) if losses else "-", last("val_loss"), _fmt(tps[len(tps) // 2]) if tps else "-",
            _fmt(max(_field(run, "peak_memory_gib")[1], default=0.0))] + (_moe_summary(run) if moe else [])


def _moe_summary(run: Run) -> list[str]:
    """The mean and max over the layers of the last logged step's load imbalance; "-" for a dense run."""
    per_layer = _per_layer(run, "moe_load_imbalance")[1]
    last = [v for v in per_layer[-1].values() if _num(v)] if per_layer else []
    return [_fmt(sum(last) / len(last)), _fmt(max(last))] if last else ["-", "-"]


def _ft_summary(run: Run) -> list[str]:
    live = _field(run, "ft_participants")[1]
    heals = "; ".join(f"{step}: {_fmt(sec)} s" for step, sec in heal_events(run))
    return [str(int(min(live))) if live else "-", heals or ("none" if live else "-")]


def report(run_dirs: list[str | Path], prefix: str | Path | None = None) -> list[Path]:
    runs = [load_run(d) for d in run_dirs]
    if len({r.name for r in runs}) < len(runs):  # same folder name in different places: use the paths
        for r, d in zip(runs, run_dirs):
            r.name = str(d)
    panels, legend = training_panels(runs)
    moe = any(_per_layer(r, "moe_load_imbalance")[0] for r in runs)
    ft = any(_field(r, "ft_participants")[0] for r in runs)
    head = ["run", "last step", "first loss", "last loss", "min loss", "last val_loss", "median tok/s",
            "peak memory GiB"] + (["last MoE imbalance mean", "last MoE imbalance max"] if moe else []) + (
            ["fewest live groups", "heals (step: seconds)"] if ft else [])
    table = [head] + [_summary(r, moe) + (_ft_summary(r) if ft else []) for r in runs]
    return write(panels, legend, "trainlib: " + ", ".join(r.name for r in runs), table,
                 prefix or Path(run_dirs[0]) / "report")


def plot_parity(report, prefix: str | Path, tol: float = 1e-5) -> list[Path]:
    """Draw a trainlib.parity.ParityReport: each layout's loss curve against the
    baseline's, and the relative deviation per step on a log axis."""
    panels, legend = parity_panels(report, tol)
    table = [["layout", "processes", "max rel. loss deviation", "max rel. grad_norm deviation"]]
    table += [[r.name, str(r.nproc), f"{r.max_rel_loss:.2e}", f"{r.max_rel_grad_norm:.2e}"] for r in report.runs]
    return write(panels, legend, f"trainlib parity against {report.baseline.name}", table, prefix)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainlib.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.png and PREFIX.html (default: RUN_DIR/report)")
    a = p.parse_args(argv)
    try:
        written = report(a.run_dirs, a.out)
    except ValueError as e:  # a missing or malformed metrics.jsonl
        print(f"trainlib.report: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"wrote {path}" for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
