"""``trainvitals report LOGDIR``: a health report per run, read from TensorBoard event files.

The event files are read with TensorBoard's own ``EventAccumulator``; every folder under LOGDIR that
holds event files is a run (TensorBoard's own notion, ``io_wrapper.GetLogdirSubdirectories``). Each
run that holds trainvitals metrics gets five sections — convergence, noise scale and batch size,
integrity, memory, spikes and non-finite steps — and a list of findings.

Exit status, for CI:

- 0: every run read, no critical finding;
- 1: a critical finding in some run (:data:`CRITICAL_COUNTERS`): non-finite gradients (outside a
  GradScaler's calibration) or losses, a loss without ``grad_fn`` or that reaches no parameter, an
  optimizer stepping before the backward of its gradients, a parameter still unused in the last check
  window, a parameter outside every optimizer (unregistered: layers in a Python list), a computation
  graph kept alive across steps (GraphIntegrityCallback's counter, or MemoryTopologyProfiler's saved
  bytes still held after backward and growing);
- 2: nothing to report: LOGDIR missing, no event files under it, or event files without trainvitals
  metrics (another tool's, or a run without trainvitals callbacks); also a usage error.

No Lightning import here: the command starts in about two seconds, most of it importing torch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing import event_accumulator, io_wrapper
from tensorboard.util import tensor_util

from trainvitals.core.estimate import DEFAULT_MAX_REL_ERR, DEFAULT_MIN_COVERAGE
from trainvitals.core.memory import format_bytes
from trainvitals.dashboard.tags import MEMORY_BYTES, TEXT_SUFFIX, grad_norm

EXIT_OK, EXIT_CRITICAL, EXIT_NO_DATA = 0, 1, 2
FORMATS = ("text", "markdown", "json")
TRAINVITALS_PREFIXES = ("grad_norm/", "grad_noise/", "lr_scaling/", "graph/", "memory/", "trainvitals/")

BAND_WINDOW = 10
"""Logged steps over which the fraction in the noise band is taken: one step is in it about half the
time from noise alone at a stationary point (docs/science.md §3), so a single flag says little."""

INTEGRITY, SPIKES = "integrity", "spikes and non-finite steps"

CRITICAL_COUNTERS = (
    (SPIKES, grad_norm("nonfinite_steps"), "non-finite (inf/NaN) gradients on {n} optimizer step(s), outside any GradScaler"),
    (INTEGRITY, r"graph/findings_loss_no_grad$",
     "the loss had no grad_fn or reached no parameter on {n} step(s): it was detached (.item(), .detach(), "
     "torch.no_grad()), nothing trains"),
    (INTEGRITY, r"graph/findings_(?:no_grad_error|second_backward|inplace_modified)$",
     "the run failed in backward with one of autograd's classic errors ({n}); the integrity panel has the diagnosis"),
    (INTEGRITY, r"graph/nonfinite_losses$", "{n} non-finite loss value(s) in one check window"),
    (INTEGRITY, r"graph/findings_step_before_backward$",
     "an optimizer stepped before the backward that gives its parameters their gradients ({n}): they never train"),
    (INTEGRITY, r"graph/unused_params$",
     "{n} parameter(s) got no gradient in the last check window: not in the loss's graph (an unused head, a "
     "detached branch)"),
    (INTEGRITY, r"graph/unoptimized_params$",
     "{n} tensor(s) get gradients but belong to no optimizer: unregistered on the module (layers in a plain "
     "Python list?) or left out of configure_optimizers; they never train"),
    (INTEGRITY, r"graph/leaked_graphs$",
     "the loss reached autograd nodes of an earlier step ({n} walk(s)): a graph kept alive across steps "
     "(total += loss, a hidden state not detached)"),
)
"""(section, tag regex, message): a counter is critical when its largest value (summed over optimizers) is > 0.

The largest, not the last: GraphIntegrityCallback's counts are per check window, and a problem seen in
any window is a problem — except unused parameters (:data:`LAST_WINDOW`)."""

LAST_WINDOW = frozenset({r"graph/unused_params$"})
"""Counters read in the last check window only: a branch taken only on some batches (an expert that got no
tokens for a while) goes unused in one window and trains in the next; a parameter that never trains is
still unused at the end."""


class ReportError(Exception):
    """Nothing to report: the message says why, for a person (exit status 2)."""


@dataclass
class Run:
    """What one run's event files hold: scalars and text panels, each a list of ``(step, value)``."""

    name: str
    scalars: dict[str, list[tuple[int, float]]]
    texts: dict[str, list[tuple[int, str]]]

    def matching(self, pattern: str) -> dict[str, list[tuple[int, float]]]:
        """The scalar series whose tag matches ``pattern`` (``re.match``, as TensorBoard matches)."""
        regex = re.compile(pattern)
        return {tag: series for tag, series in self.scalars.items() if regex.match(tag)}

    def last(self, pattern: str) -> float | None:
        """Last value of the first matching series (tags sorted), or None."""
        series = self.matching(pattern)
        return series[min(series)][-1][1] if series else None

    def text(self, tag: str) -> str | None:
        """Latest text of the panel ``tag``, or None."""
        entries = self.texts.get(tag)
        return entries[-1][1] if entries else None

    @property
    def is_trainvitals(self) -> bool:
        """Whether any tag is a trainvitals callback's (else the files are another tool's)."""
        return any(t.startswith(TRAINVITALS_PREFIXES) for t in [*self.scalars, *self.texts])


@dataclass
class Row:
    """One line of a section: a label, a value and its unit (``bytes``, ``examples``, ``steps`` or empty)."""

    label: str
    value: float | str | None
    unit: str = ""


@dataclass
class Finding:
    """A conclusion: ``critical`` fails CI, ``warning`` deserves a look, ``note`` is information."""

    severity: str
    section: str
    message: str


@dataclass
class RunReport:
    """The health report of one run."""

    run: str
    last_step: int | None
    sections: dict[str, list[Row]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    panels: dict[str, str] = field(default_factory=dict)
    """The callbacks' own end-of-run markdown (lr advice, integrity findings, memory table), by title."""

    @property
    def critical(self) -> bool:
        """Whether any finding is critical: the report's exit status is then 1."""
        return any(f.severity == "critical" for f in self.findings)


# --------------------------------------------------------------------------------------------- reading
def read_runs(logdir: str | Path) -> list[Run]:
    """Every run under ``logdir``, in name order.

    Raises:
        ReportError: when ``logdir`` is missing or not a folder, or holds no event files.
    """
    root = Path(logdir)
    if not root.exists():
        raise ReportError(f"{root} does not exist.")
    if not root.is_dir():
        raise ReportError(f"{root} is not a folder: give the TensorBoard log folder (the one passed to --logdir).")
    folders = sorted(io_wrapper.GetLogdirSubdirectories(str(root)))
    if not folders:
        raise ReportError(f"no TensorBoard event files (events.out.tfevents.*) under {root}.")
    return [_read_run(root, Path(folder)) for folder in folders]


def _read_run(root: Path, folder: Path) -> Run:
    # 0 keeps every event: a report needs the whole history, not TensorBoard's sampled reservoir.
    acc = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    ).Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags[event_accumulator.SCALARS]}
    texts = {}
    for tag in tags[event_accumulator.TENSORS]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "text":
            continue
        name = tag[: -len(TEXT_SUFFIX)] if tag.endswith(TEXT_SUFFIX) else tag
        texts[name] = [(e.step, _decode_text(e.tensor_proto)) for e in acc.Tensors(tag)]
    # A LOGDIR that is itself the run folder is named after that folder, not ".".
    name = folder.relative_to(root).as_posix() if folder != root else root.resolve().name
    return Run(name=name, scalars=scalars, texts=texts)


def _decode_text(proto: Any) -> str:
    array = tensor_util.make_ndarray(proto)
    return "\n".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))


# ------------------------------------------------------------------------------------------- assessing
def assess(run: Run) -> RunReport:
    """The health report of ``run``: one section per vital sign, and the findings that follow."""
    steps = [s for series in run.scalars.values() for s, _ in series]
    report = RunReport(run=run.name, last_step=max(steps) if steps else None)
    for section in (_convergence, _noise_scale, _integrity, _memory, _spikes):
        section(run, report)
    for title, pattern, message in CRITICAL_COUNTERS:
        n = _counter(run, pattern, last=pattern in LAST_WINDOW)
        if n > 0:
            report.findings.append(Finding("critical", title, message.format(n=f"{n:g}")))
    return report


def _panel(run: Run, report: RunReport, title: str, tag: str) -> None:
    """Pass a callback's end-of-run markdown (the text panel ``tag``) through to the report, if logged."""
    text = run.text(tag)
    if text:
        report.panels[title] = text


def _counter(run: Run, pattern: str, last: bool = False) -> float:
    """A counter's largest (``last``: last) finite value, summed over the series that match (one per optimizer)."""
    values = [[v for _, v in series if math.isfinite(v)] for series in run.matching(pattern).values()]
    return sum((v[-1] if last else max(v)) for v in values if v)


def _diverged(run: Run) -> bool:
    """Whether the run ended diverged. With GradNormMonitor's series: (nearly) every step after its last
    finite norm was non-finite — counted as non-finite, or under a GradScaler as skipped (at least two:
    one skip is calibration). A NaN the run trained on from is not the end. A non-finite loss makes the
    gradient non-finite too, so the loss counter decides only without the monitor: GraphIntegrityCallback
    logs it when a check window closes, which says nothing of when the loss was non-finite."""
    finite = [step for series in run.matching(grad_norm("total")).values() for step, v in series if math.isfinite(v)]
    counters = {1: run.matching(grad_norm("nonfinite_steps")), 2: run.matching(grad_norm("amp_skipped_steps"))}
    if not (finite or counters[1] or counters[2]):
        return _counter(run, r"graph/nonfinite_losses$") > 0
    since = max(finite, default=-1)
    return any(_rose_every_step(series, since, least) for least, matching in counters.items()
               for series in matching.values())


def _rose_every_step(series: list[tuple[int, float]], since: int, least: int) -> bool:
    """A step counter rose by (nearly) every step logged after ``since``, and by at least ``least``."""
    before = max((count for step, count in series if step <= since), default=0.0)
    step, count = series[-1]
    return step > since and count - before >= max(least, step - since - 1)


def _convergence(run: Run, report: RunReport) -> None:
    title = "convergence"
    # Like with like: a partly measured model's floor is set against the norm of the measured parameters.
    total = run.last(grad_norm("measured_total"))
    total = run.last(grad_norm("total")) if total is None else total
    floor = run.last(grad_norm("noise_floor"))  # the run's one floor (core/estimate.py)
    floor_se = run.last(grad_norm("noise_floor_se"))
    partial = _partial(run)
    band = run.matching(grad_norm("in_noise_band"))
    recent = [v for _, v in band[min(band)][-BAND_WINDOW:]] if band else []
    in_band = sum(recent) / len(recent) if recent else None
    stop = run.text("grad_norm/stop_reason")
    report.sections[title] = [
        Row("gradient norm, last", total),
        Row("noise floor sqrt(tr Σ/B), last", floor),
        Row("noise floor standard error", floor_se),
        Row("norm / noise floor", total / floor if total is not None and floor else None),
        Row(f"fraction in the noise band, last {len(recent)} logged steps", in_band),
        Row("stop", stop),
    ]
    if stop:
        report.findings.append(Finding("note", title, stop))
    caveat = run.text("grad_noise/caveat")
    if caveat:
        report.findings.append(Finding("note", title, caveat.removeprefix("trainvitals GradNormEarlyStopping: ")))
    error = (f" (noise floor ± {floor_se / floor:.0%})" if floor and floor_se is not None and math.isfinite(floor_se)
             else "")
    if _diverged(run):
        report.findings.append(Finding(
            "note", title, "the run diverged (non-finite gradients or losses): the last finite gradient norm and "
            "the noise estimates come from before, so they say nothing of convergence."))
    elif partial:
        report.findings.append(Finding("note", title, f"{partial}: no noise-band verdict on the whole model."))
    elif in_band is None:
        if total is not None and floor:
            report.findings.append(Finding(
                "note", title, f"the last gradient norm is {total / floor:.2f}× its noise floor{error}; GradNormEarlyStopping "
                "would log whether the run is in its noise band."))
        elif total is not None:
            report.findings.append(Finding(
                "note", title, "no noise estimate, so no noise band: it needs accumulate_grad_batches >= 2, "
                ">= 2 devices, or a BatchVarianceProbe; a fixed norm threshold is no substitute."))
    elif in_band >= 0.5:
        report.findings.append(Finding(
            "note", title, f"in its noise band ({in_band:.0%} of the last {len(recent)} logged steps){error}: "
            "the gradient norm sits at its noise floor, further steps mostly move within noise."))
    else:
        ratio = f" (the last norm is {total / floor:.2f}× the noise floor)" if total is not None and floor else ""
        report.findings.append(Finding(
            "note", title, f"not in its noise band yet: {in_band:.0%} of the last {len(recent)} logged steps were in it{ratio}{error}; "
            "the true gradient still stands out of the noise."))


def _partial(run: Run) -> str:
    """"partial: …" when the run's noise estimate covered too little of ‖ḡ‖² to decide; else ""."""
    coverage = run.last(r"grad_noise/coverage$")
    if coverage is None or coverage >= DEFAULT_MIN_COVERAGE:
        return ""
    return f"partial: the noise estimate covers {coverage:.0%} of ‖ḡ‖² (a decision needs {DEFAULT_MIN_COVERAGE:.0%})"


def _noise_scale(run: Run, report: RunReport) -> None:
    title = "noise scale and batch size"
    b_simple = run.last(r"grad_noise/b_simple$")  # the run's one B_simple (core/estimate.py)
    rel_err = run.last(r"grad_noise/b_simple_rel_err$")
    unreliable = run.last(r"grad_noise/b_simple_unreliable$")
    coverage = run.last(r"grad_noise/coverage$")
    batch = run.last(r"lr_scaling/effective_batch$")
    rows = [Row("B_simple = tr Σ / ‖G‖²", b_simple, "examples"), Row("B_simple relative error", rel_err),
            Row("share of ‖ḡ‖² measured", coverage), Row("effective batch B", batch, "examples")]
    rows += [Row(tag.removeprefix("lr_scaling/"), series[-1][1]) for tag, series in sorted(run.matching(
        r"lr_scaling/(?!effective_batch$).+").items())]
    report.sections[title] = rows
    partial = _partial(run)
    if b_simple is not None and partial:
        report.findings.append(Finding("note", title, f"{partial}: no batch-size verdict, and no noise-aware lr advice."))
    elif b_simple is not None and (unreliable == 1 or rel_err is not None and not rel_err <= DEFAULT_MAX_REL_ERR):
        what = f"relative error {rel_err:.2g}" if rel_err is not None and math.isfinite(rel_err) else "no error bar yet"
        report.findings.append(Finding(
            "note", title, f"B_simple = {b_simple:.3g} is unreliable ({what}): no batch-size verdict; the lr advice "
            "follows the classic rules."))
    elif b_simple is not None and batch and math.isfinite(b_simple):
        spread = f" (± {rel_err:.0%})" if rel_err is not None else " (its error was not logged)"
        if batch < b_simple:
            message = (f"B = {batch:g} < B_simple = {b_simple:.3g}{spread}: each step is noise-dominated; a batch near "
                       "B_simple balances steps against examples.")
        else:
            message = (f"B = {batch:g} >= B_simple = {b_simple:.3g}{spread}: beyond the noise scale a larger batch buys "
                       "few steps for its examples.")
        report.findings.append(Finding("note", title, message))
    if _diverged(run) and run.matching(r"lr_scaling/"):
        report.findings.append(Finding(
            "note", title, "the run diverged: find the cause (or lower the lr) before following any lr-scaling advice."))
    _panel(run, report, "lr scaling advice", "lr_scaling/advice")


def _integrity(run: Run, report: RunReport) -> None:
    title = INTEGRITY
    # The per-kind finding counts (graph/findings_<kind>) are left to the findings panel.
    report.sections[title] = [Row(tag.removeprefix("graph/"), series[-1][1])
                              for tag, series in sorted(run.matching(r"graph/(?!findings_).+").items())]
    _panel(run, report, "integrity findings", "graph/findings")


def _memory(run: Run, report: RunReport) -> None:
    title = "memory"
    categories = sorted(((series[-1][1], tag.removeprefix("memory/").removesuffix("_bytes"))
                         for tag, series in run.matching(MEMORY_BYTES).items()), reverse=True)
    rows = [Row(category.replace("_", " "), value, "bytes") for value, category in categories]
    per_module = sorted(((series[-1][1], tag.removeprefix("memory/activations/"))
                         for tag, series in run.matching(r"memory/activations/.+").items()), reverse=True)
    rows += [Row(f"saved by {module}", value, "bytes") for value, module in per_module[:5]]
    report.sections[title] = rows
    _panel(run, report, "memory table", "memory/report")
    held = [v for _, v in run.scalars.get("memory/held_saved_bytes", [])]
    if len(held) >= 2 and held[-1] > held[-2] > 0:
        report.findings.append(Finding(
            "critical", title, f"a computation graph outlives its step: {format_bytes(held[-1])} of saved tensors "
            f"still held after backward, up from {format_bytes(held[-2])} at the previous profiled step "
            "(total += loss, a hidden state not detached, retain_graph=True)"))


def _spikes(run: Run, report: RunReport) -> None:
    title = SPIKES
    names = [n for n in ("nonfinite_steps", "amp_skipped_steps", "spike_steps") if run.matching(grad_norm(n))]
    counters = {name: _counter(run, grad_norm(name)) for name in names}
    report.sections[title] = [Row(name.replace("_", " "), value, "steps") for name, value in counters.items()]
    if counters.get("amp_skipped_steps", 0) > 0:
        report.findings.append(Finding(
            "note", title, f"the GradScaler skipped {counters['amp_skipped_steps']:g} step(s) with inf/NaN "
            "gradients and lowered its scale: loss-scale calibration, not divergence."))
    if counters.get("spike_steps", 0) > 0:
        latest = next((run.text(t) for t in sorted(run.texts) if re.match(grad_norm("spikes"), t)), None)
        report.findings.append(Finding(
            "warning", title, f"{counters['spike_steps']:g} gradient-norm spike(s)" + (f"; latest: {latest}" if latest else "")))


# ------------------------------------------------------------------------------------------- rendering
def render(reports: Sequence[RunReport], fmt: str, skipped: Sequence[str] = ()) -> str:
    """The reports as ``text``, ``markdown`` or ``json``; ``skipped`` names runs without trainvitals data."""
    if fmt == "json":
        return json.dumps(_json_safe({
            "critical": any(r.critical for r in reports),
            "runs": [{**asdict(r), "critical": r.critical} for r in reports],
            "skipped_runs": list(skipped),
        }), indent=2, allow_nan=False) + "\n"
    markdown = fmt == "markdown"
    out: list[str] = []
    for r in reports:
        status = "CRITICAL" if r.critical else "ok"
        step = f", last logged optimizer step {r.last_step}" if r.last_step is not None else ""
        out.append(f"## run `{r.run}`: {status}{step}" if markdown else f"run {r.run}: {status}{step}")
        for title, rows in r.sections.items():
            if not rows:
                continue
            if markdown:
                out += ["", f"### {title}", "", "| measure | value |", "|---|---|"]
                out += [f"| {row.label} | {_cell(_fmt(row))} |" for row in rows]
            else:
                width = max(len(row.label) for row in rows)
                out += ["", f"  {title}"] + [f"    {row.label:<{width}}  {_fmt(row)}" for row in rows]
        out += (["", "### findings", ""] if markdown else ["", "  findings"]) if r.findings else []
        for f in r.findings:
            out.append(f"- **{f.severity}** ({f.section}): {f.message}" if markdown
                       else f"    [{f.severity}] {f.section}: {f.message}")
        for title, text in r.panels.items():
            out += ["", f"### {title}", "", text] if markdown else ["", f"  {title}", textwrap.indent(text, "    ")]
        out.append("")
    if skipped:
        out.append(f"runs without trainvitals metrics, not reported: {', '.join(skipped)}")
    return "\n".join(out).rstrip() + "\n"


def _json_safe(obj: Any) -> Any:
    """``inf``/``nan`` (B_simple when ‖G‖² ≤ 0) as the strings ``"inf"``/``"nan"``: JSON has no such numbers."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _fmt(row: Row) -> str:
    v = row.value
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if row.unit == "bytes":
        return format_bytes(v)
    text = f"{v:.4g}"
    return f"{text} {row.unit}" if row.unit else text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


# ---------------------------------------------------------------------------------------------- command
DESCRIPTION = ("Health report of the training runs under LOGDIR, read from their TensorBoard event files. "
               "Exit status: 0 healthy, 1 a critical finding, 2 nothing to report.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """LOGDIR and ``--format``, on ``parser`` (the ``trainvitals report`` subcommand's, or :func:`main`'s)."""
    parser.add_argument("logdir", metavar="LOGDIR", help="the TensorBoard log folder")
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")


def run(args: argparse.Namespace) -> int:
    """Report on ``args.logdir`` in ``args.format``; returns the exit status (see the module docstring)."""
    try:
        runs = read_runs(args.logdir)
    except ReportError as err:
        print(f"trainvitals report: {err}", file=sys.stderr)
        return EXIT_NO_DATA
    ours = [r for r in runs if r.is_trainvitals]
    if not ours:
        print(f"trainvitals report: the event files under {args.logdir} ({len(runs)} run(s)) hold no trainvitals "
              "metrics: they come from another tool, or from a run without trainvitals callbacks.", file=sys.stderr)
        return EXIT_NO_DATA
    reports = [assess(r) for r in ours]
    sys.stdout.write(render(reports, args.format, skipped=[r.name for r in runs if not r.is_trainvitals]))
    return EXIT_CRITICAL if any(r.critical for r in reports) else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """``trainvitals report`` on its own command line; returns the exit status, 2 on a usage error."""
    parser = argparse.ArgumentParser(prog="trainvitals report", description=DESCRIPTION)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2): argparse has printed why
        return int(exit_.code or 0)
    return run(args)
