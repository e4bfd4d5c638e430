"""``trainvitals report LOGDIR --format html``: one self-contained HTML file per report.

The same findings, sections and callback panels as the text report, with matplotlib plots of what the
run logged: the gradient norm in its noise band (log scale), B_simple with its error band against the
effective batch, the per-layer norms over steps as a heatmap, memory by category and module, and the lr
suggestions per batch size. Images are inline base64 PNGs and the style sheet is inline: the file opens
without a network and sends no request.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from trainvitals.report.assess import memory_label
from trainvitals.report.events import Run
from trainvitals.report.guard import guard_events
from trainvitals.report.model import EXIT_NO_DATA, EXIT_OK, RunReport, first_series
from trainvitals.report.render import EMPTY_RUNS, format_value, heading, overview_markdown, status_line
from trainvitals.tags import MEMORY_BYTES, PER_LAYER_GRAD_NORM, SUGGESTED_LR, grad_norm
from trainvitals.text.markdown import markdown_to_html

Series = list[tuple[int, float]]

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
h3 { margin-top: 1.4em; } .ok { color: #1a7f37; } .critical { color: #c62828; }
ul.findings li { margin: .3em 0; } .sev { font-weight: 600; text-transform: uppercase; font-size: .8em;
  padding: .1em .4em; border-radius: 3px; margin-right: .4em; }
.sev.critical { background: #fdecea; } .sev.warning { background: #fff4e5; color: #8a5300; }
.sev.note { background: #eef3fb; color: #1f4e99; }
table { border-collapse: collapse; margin: .6em 0; } td, th { border: 1px solid #ddd; padding: .25em .6em;
  text-align: left; vertical-align: top; } th { background: #f6f8fa; } td.num { text-align: right; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr)); gap: 1em; }
figure { margin: 0; } figure img { width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: .9em; color: #555; } details { margin: .5em 0; } summary { cursor: pointer; font-weight: 600; }
code { background: #f6f8fa; padding: 0 .2em; border-radius: 3px; }
"""


def render_html(runs: Sequence[tuple[Run, RunReport]], skipped: Sequence[str] = (), empty: Sequence[str] = ()) -> str:
    """The HTML page of the reports; ``runs`` pairs each run's data (for the plots) with its report; an
    overview table first when there are several."""
    body = ["<h1>trainvitals report</h1>"]
    if len(runs) > 1:
        body.append(markdown_to_html("\n".join(overview_markdown([report for _, report in runs]))))
    for run, report in runs:
        body += _run_html(run, report)
    if skipped:
        body.append(f"<p>Runs without trainvitals metrics, not reported: {html.escape(', '.join(skipped))}</p>")
    if empty:
        body.append(f"<p>{html.escape(EMPTY_RUNS)}: {html.escape(', '.join(empty))}</p>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>trainvitals report</title><style>{STYLE}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _run_html(run: Run, report: RunReport) -> list[str]:
    state = "ok" if report.exit_status in (EXIT_OK, EXIT_NO_DATA) else "critical"  # a crash too, in red
    out = [
        f'<h2>run <code>{html.escape(report.names)}</code>: <span class="{state}">{html.escape(status_line(report))}</span></h2>'
    ] + ([f"<p>{html.escape(report.same_logs_said)}.</p>"] if report.same_logs else [])
    if report.findings:
        out.append('<h3>findings</h3><ul class="findings">')
        out += [
            f'<li><span class="sev {html.escape(f.severity)}">{html.escape(f.severity)}</span>'
            f"<b>{html.escape(f.section)}</b>: {html.escape(f.message)}</li>"
            for f in report.findings
        ]
        out.append("</ul>")
    figures = [fig for fig in (plot(run) for plot in PLOTS) if fig is not None]
    if figures:
        out.append('<h3>plots</h3><div class="plots">')
        out += [
            f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{png}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            for png, caption in figures
        ]
        out.append("</div>")
    for title, rows in report.sections.items():
        if rows:
            out.append(f"<h3>{html.escape(heading(report, title))}</h3><table><tr><th>measure</th><th>value</th></tr>")
            out += [
                f'<tr><td>{html.escape(row.label)}</td><td class="{"num" if isinstance(row.value, float) else ""}">'
                f"{html.escape(format_value(row))}</td></tr>"
                for row in rows
            ]
            out.append("</table>")
    for title, text in report.panels.items():
        out.append(
            f"<details open><summary>{html.escape(heading(report, title))}</summary>{markdown_to_html(text)}</details>"
        )
    return out


# ---------------------------------------------------------------------------------------------- plots
def _png(draw: Callable[[Any], None], size: tuple[float, float] = (7.0, 3.6)) -> str:
    """A base64 PNG of what ``draw(ax)`` puts on one matplotlib axis (the Agg backend: no display needed)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100, layout="constrained")
    draw(fig.subplots())
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _first(run: Run, *patterns: str) -> Series | None:
    """The first logged series matching one of ``patterns`` (tried in order), finite values only."""
    series = first_series(run, *patterns)
    return None if series is None else [(s, v) for s, v in series if math.isfinite(v)]


def _xy(series: Series) -> tuple[list[int], list[float]]:
    return [s for s, _ in series], [v for _, v in series]


def _marker(series: Series) -> dict[str, Any]:
    """A point marker for a series of one logged step, which a line alone does not draw."""
    return {"marker": "o"} if len(series) == 1 else {}


def _one_step(ax: Any, *series: Series | None) -> None:
    """An x range around the step when every series is of that one step: matplotlib's own would be empty."""
    steps = {s for points in series if points for s, _ in points}
    if len(steps) == 1:
        (step,) = steps
        ax.set_xlim(step - 1, step + 1)


def _aligned(base: Series, other: Series | None) -> list[float] | None:
    """``other``'s value at each step of ``base`` (None where it has none)."""
    if other is None:
        return None
    by_step = dict(other)
    return [by_step.get(s, math.nan) for s, _ in base]


def _norm_in_band(run: Run) -> tuple[str, str] | None:
    total = _first(run, grad_norm("total"))
    if not total:
        return None
    floor = _first(run, grad_norm("noise_floor"), r"grad_noise/noise_floor$")
    edge = _first(run, grad_norm("band_edge"))
    clipped = _first(run, grad_norm("clipped_total"))

    def draw(ax: Any) -> None:
        ax.plot(*_xy(total), color="#1f77b4", lw=1.2, label="‖g‖, total gradient norm", **_marker(total))
        if clipped:
            ax.plot(*_xy(clipped), color="#9467bd", lw=0.8, label="‖g‖ after clipping", **_marker(clipped))
        if floor:
            ax.plot(*_xy(floor), color="#d62728", lw=1.2, label="noise level sqrt(tr Σ/B)", **_marker(floor))
        if floor and edge:
            upper = _aligned(floor, edge)
            ax.fill_between(_xy(floor)[0], _xy(floor)[1], upper, color="#d62728", alpha=0.15, label="noise band")
        _one_step(ax, total, clipped, floor)
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("gradient norm")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")

    return _png(draw), "The gradient norm against its noise level (log scale); shaded, the noise band up to its edge."


def _b_simple(run: Run) -> tuple[str, str] | None:
    b_simple = _first(run, r"grad_noise/b_simple$", grad_norm("b_simple")) or []
    # Where ‖G‖² ≤ 0 the point is infinite and not written, but its lower end is: drawn alone, the latest news
    # where the run ends so (the report's section is of that step too).
    points = {s for s, _ in b_simple}
    ends_only = [(s, v) for s, v in _first(run, r"grad_noise/b_simple_low$") or [] if s not in points and v > 0]
    if not b_simple and not ends_only:
        return None
    batch = _first(run, r"lr_scaling/effective_batch$")
    steps, values = _xy(b_simple)
    # The estimate's own 90% (Fieller) interval, as every message quotes it; its high end logged only while finite.
    nothing = [math.nan] * len(values)
    lower = _aligned(b_simple, _first(run, r"grad_noise/b_simple_low$")) or nothing
    upper = _aligned(b_simple, _first(run, r"grad_noise/b_simple_high$")) or nothing
    bare = [(s, v) for s, v, lo, hi in zip(steps, values, lower, upper) if not math.isfinite(lo + hi)]

    def draw(ax: Any) -> None:
        ax.plot(steps, values, color="#2ca02c", lw=1.2, label="B_simple = tr Σ / ‖G‖²", **_marker(b_simple))
        if len(bare) < len(values):
            bounded = [math.isfinite(lo + hi) for lo, hi in zip(lower, upper)]
            ax.fill_between(
                steps,
                [max(lo, 1e-12) if ok else math.nan for lo, ok in zip(lower, bounded)],
                [hi if ok else math.nan for hi, ok in zip(upper, bounded)],
                color="#2ca02c",
                alpha=0.2,
                label="90 % interval (Fieller)",
            )
        if bare:
            ax.plot(*_xy(bare), ls="none", marker="o", mfc="none", color="#2ca02c", label="no upper bound yet")
        if ends_only:
            ax.plot(
                *_xy(ends_only), ls="none", marker="^", color="#2ca02c", label="no point (‖G‖² ≤ 0): 90 % lower end"
            )
        if batch:
            ax.plot(*_xy(batch), color="black", lw=1, ls="--", label="effective batch B", **_marker(batch))
        _one_step(ax, b_simple, batch, ends_only)
        positive = [v for v in values + [v for _, v in ends_only] if v > 0]
        if positive and max(positive) / min(positive) > 30:
            ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("examples")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    caption = "The gradient noise scale B_simple against the effective batch: below it, steps are noise-dominated."
    if bare:
        caption += (
            f" Hollow points ({len(bare)} of {len(values)} logged steps): no two-sided 90 % interval, B_simple "
            "not yet bounded above there."
        )
    if ends_only:
        caption += (
            f" Triangles ({len(ends_only)} logged steps, the last at optimizer step {ends_only[-1][0]}): no point "
            "estimate there (the smoothed ‖G‖² ≤ 0), its 90 % lower end alone."
        )
    return _png(draw), caption


def _layer_heatmap(run: Run) -> tuple[str, str] | None:
    layers = {
        tag.removeprefix("grad_norm/"): series for tag, series in sorted(run.matching(PER_LAYER_GRAD_NORM).items())
    }
    if not layers:
        return None
    steps = sorted({s for series in layers.values() for s, _ in series})
    first, last = (steps[0], steps[-1]) if len(steps) > 1 else (steps[0] - 0.5, steps[0] + 0.5)  # one column
    column = {s: k for k, s in enumerate(steps)}
    grid = [[math.nan] * len(steps) for _ in layers]
    for row, series in enumerate(layers.values()):
        for s, v in series:
            if math.isfinite(v) and v > 0:
                grid[row][column[s]] = math.log10(v)

    def draw(ax: Any) -> None:
        image = ax.imshow(
            grid, aspect="auto", interpolation="nearest", cmap="viridis", extent=(first, last, len(layers) - 0.5, -0.5)
        )
        ax.set_yticks(range(len(layers)), list(layers), fontsize=8)
        ax.set_xlabel("optimizer step")
        ax.figure.colorbar(image, ax=ax, label="log10 ‖g‖ of the layer")

    height = max(2.5, 0.3 * len(layers) + 1.2)
    return _png(
        draw, (7.0, height)
    ), "Per-layer gradient norms over the steps (log10): which layer carries the gradient."


def _memory(run: Run) -> tuple[str, str] | None:
    categories = {
        memory_label(tag.removeprefix("memory/").removesuffix("_bytes")): series[-1][1]
        for tag, series in run.matching(MEMORY_BYTES).items()
        if series[-1][1] > 0
    }
    modules = {
        tag.removeprefix("memory/activations/"): series[-1][1]
        for tag, series in run.matching(r"memory/activations/.+").items()
        if series[-1][1] > 0
    }
    bars = [(f"module {k}", v) for k, v in sorted(modules.items(), key=lambda kv: kv[1])]
    bars += [(k, v) for k, v in sorted(categories.items(), key=lambda kv: kv[1])]
    if not bars:
        return None

    def draw(ax: Any) -> None:
        labels, values = zip(*bars)
        colors = ["#ff7f0e" if label.startswith("module ") else "#1f77b4" for label in labels]
        ax.barh(range(len(bars)), [v / 2**10 for v in values], color=colors)
        ax.set_yticks(range(len(bars)), labels, fontsize=8)
        ax.set_xlabel("KiB (last profiled step)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3, axis="x")

    return (
        _png(draw, (7.0, max(2.5, 0.28 * len(bars) + 1.0))),
        "Memory by category (blue) and the activations each module saves for backward (orange).",
    )


def _lr_suggestions(run: Run) -> tuple[str, str] | None:
    suggested: dict[str, dict[float, float]] = {}
    for tag, series in run.matching(r"lr_scaling/suggested_lr_x[0-9.]+/.+$").items():
        match = SUGGESTED_LR.match(tag.removeprefix("lr_scaling/"))
        if match and match["factor"] and math.isfinite(series[-1][1]):
            suggested.setdefault(match["group"], {})[float(match["factor"])] = series[-1][1]
    batch = run.last(r"lr_scaling/effective_batch$")
    if not suggested:
        return None

    def draw(ax: Any) -> None:
        for optimizer, by_factor in sorted(suggested.items()):
            now = run.last(rf"lr_scaling/base_lr/{re.escape(optimizer)}$")  # the lr the suggestions scale
            points = sorted({**by_factor, **({1.0: now} if now is not None else {})}.items())
            xs = [f * batch if batch else f for f, _ in points]
            line = ax.plot(xs, [lr for _, lr in points], marker="o", label=optimizer)[0]
            if now is not None:
                ax.plot([batch if batch else 1.0], [now], marker="*", ms=14, color=line.get_color(), ls="none")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("effective batch (examples)" if batch else "batch multiple")
        ax.set_ylabel("learning rate")
        ax.legend(fontsize=8, title="★ this run's base lr")
        ax.grid(alpha=0.3, which="both")

    return _png(draw), (
        "The base lr LRScalingAdvisor suggests for each batch size (★: the current batch and base lr, the one set)."
    )


def _guard_actions(run: Run) -> tuple[str, str] | None:
    skipped, rollbacks = _first(run, r"guard/skipped_steps$"), _first(run, r"guard/rollbacks$")
    events, _ = guard_events(run)
    if not events:
        return None
    style = {"skip": ("o", "#ff7f0e"), "rollback": ("s", "#d62728"), "stop": ("X", "black"), "warn": ("^", "#7f7f7f")}

    def draw(ax: Any) -> None:
        for series, label, color in ((skipped, "steps skipped", "#ff7f0e"), (rollbacks, "rollbacks", "#d62728")):
            if series:
                ax.step(*_xy(series), where="post", color=color, lw=1.2, label=label)
        for action, (marker, color) in style.items():
            at = [e["global_step"] for e in events if e["action"] == action]
            if at:
                ax.plot(at, [0] * len(at), ls="none", marker=marker, color=color, label=f"event: {action}")
        _one_step(ax, skipped, rollbacks, [(e["global_step"], 0.0) for e in events])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("count since the run began")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    return _png(draw), "TrainingGuard's actions: each event at its optimizer step, and its counters over the run."


PLOTS: tuple[Callable[[Run], tuple[str, str] | None], ...] = (
    _norm_in_band,
    _guard_actions,
    _b_simple,
    _layer_heatmap,
    _memory,
    _lr_suggestions,
)
"""Each returns ``(base64 PNG, caption)``, or None when the run did not log what it plots."""
