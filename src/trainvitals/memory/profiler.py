"""Where a training step's memory goes: parameters, gradients, optimizer state, the batch and the
activations autograd saves for backward, per module; graphs kept alive by mistake; remedies ranked by
the bytes they free (docs/science.md §5).

The saved-tensor accounting (``torch.autograd.graph.saved_tensors_hooks``, attributed to the innermost
running module, deduplicated by storage, parameters/buffers/batch excluded) runs on any device. On
CUDA the allocator's peaks, retries and OOM count come on top, and optionally a memory snapshot for
PyTorch's memory viewer (https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from trainvitals._validation import check_bool, check_int
from trainvitals.memory.categories import AllocatorStats, StepMemory, category_markdown, category_metrics
from trainvitals.memory.leaks import GraphLeakFinding, HeldGraphTracker, graph_holders
from trainvitals.memory.recorder import ROOT, SavedTensorRecorder
from trainvitals.memory.remedies import Remedy, rank_remedies
from trainvitals.memory.storage import byte_unit, element_bytes, format_bytes, model_state_bytes, tensors_in
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.sharing import SUMMARY
from trainvitals.plumbing.writers import log_image, log_scalars, log_text, tensorboard_writers
from trainvitals.text.markdown import markdown_table
from trainvitals.text.terminal import markdown_to_text

_SNAPSHOT_MAX_ENTRIES = 100_000  # alloc/free events kept by the snapshot's ring buffer (a few KB each)


@dataclass
class _Pending:
    """A profiled step between its first batch start and its optimizer step."""

    step: int
    batch_size: int  # 0 when the batch has no tensor with a batch dimension
    inputs_bytes: int
    start: float  # perf_counter at the batch start
    recorder: SavedTensorRecorder
    micro_batches: int = 1  # batches started for this optimizer step (gradient accumulation)


class LeakFindings(list):  # list[GraphLeakFinding]
    """The profiler's graph-leak findings, saved as dicts: plain types, which any checkpoint loader reads."""

    def state_dict(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(f) for f in self]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self[:] = [GraphLeakFinding(**{**f, "holders": tuple(f["holders"])}) for f in state]


class MemoryTopologyProfiler(TrainvitalsCallback):
    """Profile the memory of a training step every ``measure_every_n_steps`` optimizer steps and the first ones.

    A profiled step records the forward (from ``on_train_batch_start`` to the first
    ``on_before_backward``) with a :class:`~trainvitals.memory.SavedTensorRecorder` and, once the
    optimizer step is done, logs in bytes (per rank, from rank zero; the categories are the rows of
    :data:`~trainvitals.memory.categories.MEMORY_CATEGORIES`):

    - ``memory/parameters_bytes`` (and of those ``memory/frozen_parameters_bytes``, the ones without
      ``requires_grad``, when there are any), ``memory/buffers_bytes``, ``memory/gradients_bytes``,
      ``memory/optimizer_state_bytes`` (every tensor in ``optimizer.state``), ``memory/inputs_bytes``
      (the batch's own elements), ``memory/parameter_copies_bytes`` (the 16-bit parameter copies that
      autocast saves: batch-independent),
      ``memory/activations_bytes`` and ``memory/activations/<module>`` for the ``max_modules_shown``
      modules that own the most (saved for backward, owned by the innermost module; ``(root)`` is the
      model's own forward, ``(outside)`` the loss and other code outside any module),
      ``memory/held_saved_bytes`` (saved tensors of profiled steps still
      held after backward: 0 unless a graph outlives its step);
    - on CUDA ``memory/peak_allocated_bytes``, ``memory/peak_reserved_bytes`` (peaks reset at each
      profiled step), ``memory/temporaries_bytes`` (peak allocated minus the categories above; negative
      when they do not all coexist at the peak), ``memory/alloc_retries`` and ``memory/ooms``
      (cumulative allocator counters);
    - ``memory/<key>_bytes`` of each category registered besides
      (:func:`~trainvitals.memory.categories.register_category`);
    - ``memory/largest_batch`` when there is a budget: the largest batch that fits it, with the
      activations, inputs and temporaries scaled with the batch.

    A graph kept alive across steps (saved bytes that are still held after backward and grow step
    over step) becomes a finding, with the module attributes that hold a graph; it is warned once and
    listed in :attr:`findings`. ``self.running_loss = self.running_loss + loss`` alone keeps only the
    graph's nodes (backward frees their saved tensors); with ``backward(retain_graph=True)``, the
    usual "fix" for the error it then causes, or a branch that backward never reaches, it keeps every
    saved tensor, and that is what is found. At the end of training the table
    (:meth:`summary_markdown`: categories, saved bytes per module, ranked remedies, findings) goes to
    the console and to TensorBoard text ``memory/report``, and a bar chart of saved bytes per module
    (:meth:`picture`) to TensorBoard image ``memory/saved_bytes_by_module`` (needs matplotlib).

    Remedies (:attr:`remedies`, the most bytes off the step's peak first): activation checkpointing of
    the ``top_k`` modules that lower the peak the most (backward recomputes a checkpointed module with
    its saves held again; cost: the module's forward time over the step's time), mixed precision (half
    the float32 saved bytes, an upper bound), the optimizer state; each with the largest batch that fits
    the budget afterwards.

    Under ``torch.compile`` the profiler puts no hook inside a compiled region (it would break the graph
    and change what it saves) and, for a compiled module or training step, says so once: the region's
    saved tensors are counted as a whole, the graphs and the saved bytes are those of the same compiled
    model without the profiler. Inside a compiled helper (a method or function that calls submodules) its
    module hooks do nothing; Dynamo compiles the helper twice (with and without
    them), both cached, when some steps are profiled and others not.

    Numbers are per rank (each rank measures its own batch); rank zero logs its own. Nothing is
    exchanged between ranks. The profiler keeps only weak references to what a step saved, so it
    never keeps a graph alive. A profiled step costs a pack hook per saved tensor, two hooks per
    module, forward timing of the modules to advise on (all modules at the first profiled step;
    CUDA events) and, on CUDA, two device syncs; other steps cost two comparisons. Under manual
    optimization the recorded forward is what runs before the first ``manual_backward``.

    Args:
        measure_every_n_steps: profile every this many optimizer steps.
        first_steps: also profile the first this many steps of each fit (a leak shows from the second); a
            fit resumed from a checkpoint continues the count rather than profiling its first steps again.
        memory_budget_bytes: the memory one rank's step must fit, for the largest-batch advice;
            defaults to the device's total memory on CUDA; on CPU there is no default, and no batch
            advice without it.
        top_k: how many modules to advise checkpointing of.
        snapshot_steps: on CUDA, record the allocator's history over the first this many optimizer
            steps and write ``memory_snapshot_rank<r>.pickle`` to the Trainer's log directory
            (``torch.cuda.memory._dump_snapshot``); 0 for none.
        max_modules_shown: modules logged, listed in the table and drawn in the picture (those that
            own the most saved bytes); each logged scalar costs a logger write.
        strict: raise when a step cannot be measured fully (saved tensors without a storage, no batch
            size) instead of warning once.
        verbose: also print the table at the end of training. By default the terminal gets the one
            line at fit end; the table goes to TensorBoard (``memory/report``), ``trainvitals report``
            and :meth:`summary_markdown`.

    Raises:
        TypeError: if an argument has the wrong type, ValueError if it is out of range, naming it.
    """

    provides = (SUMMARY,)

    def __init__(
        self,
        measure_every_n_steps: int = 50,
        first_steps: int = 3,
        memory_budget_bytes: int | None = None,
        top_k: int = 3,
        snapshot_steps: int = 0,
        max_modules_shown: int = 20,
        strict: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__()
        self.measure_every_n_steps = check_int("measure_every_n_steps", measure_every_n_steps, 1)
        self.first_steps = check_int("first_steps", first_steps, 0)
        self.memory_budget_bytes = check_int("memory_budget_bytes", memory_budget_bytes, 1, none_ok=True)
        self.top_k = check_int("top_k", top_k, 0)
        self.snapshot_steps = check_int("snapshot_steps", snapshot_steps, 0)
        self.max_modules_shown = check_int("max_modules_shown", max_modules_shown, 1)
        self.strict = check_bool("strict", strict)
        self.verbose = check_bool("verbose", verbose)
        self.key_state_by(measure_every_n_steps=self.measure_every_n_steps, first_steps=self.first_steps)

        # What a fit that has not started knows.
        self.findings: LeakFindings
        """Graphs kept alive across steps, the latest observation of each; survives a resume."""
        self.add_state("findings", LeakFindings)
        self.remedies: list[Remedy]
        """The remedies of the latest profiled step, the most bytes off the step's peak first."""
        self.add_state("remedies", [], persistent=False)
        self.last: StepMemory | None
        """The latest profiled step's bytes."""
        self.add_state("last", None, persistent=False)
        self.last_metrics: dict[str, float]
        """The latest profiled step's logged numbers."""
        self.add_state("last_metrics", {}, persistent=False)
        self.add_state("_last_profiled_step", -1, key="last_profiled_step")
        # Steps profiled so far in this run; a resumed fit continues the count.
        self.add_state("_profiled_steps", 0, key="profiled_steps")
        self.add_state("_last_step", -1, persistent=False)  # the step of `last`
        self.add_state("_tracker", HeldGraphTracker, persistent=False)
        # Modules whose forward is timed (for the cost of checkpointing them): all on the first
        # profiled step, then the previous step's checkpointing candidates (CUDA events are not free).
        self._timed: set[str] | None
        self.add_state("_timed", None, persistent=False)
        self._pending: _Pending | None  # the step being profiled
        self.add_state("_pending", None, persistent=False)
        self._device: torch.device
        self.add_state("_device", torch.device("cpu"), persistent=False)
        self._budget: int | None  # the argument, else (CUDA) the device's memory
        self.add_state("_budget", self.memory_budget_bytes, persistent=False)
        self._snapshot_path: str | None  # while the allocator's history is recorded
        self.add_state("_snapshot_path", None, persistent=False)

    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._device = trainer.strategy.root_device
        cuda = self._device.type == "cuda"
        if self._budget is None and cuda:
            self._budget = torch.cuda.get_device_properties(self._device).total_memory
        if self.snapshot_steps and not cuda:
            self.warn(f"`snapshot_steps` needs CUDA; no memory snapshot on {self._device.type}.", once=True)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.snapshot_steps and self._device.type == "cuda":
            # log_dir broadcasts: every rank must ask, here, at the same point.
            directory = trainer.log_dir or trainer.default_root_dir
            os.makedirs(directory, exist_ok=True)
            self._snapshot_path = os.path.join(directory, f"memory_snapshot_rank{trainer.global_rank}.pickle")
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_MAX_ENTRIES, device=self._device)

    def _due(self, step: int) -> bool:
        if step == self._last_profiled_step:
            return False
        return self._profiled_steps < self.first_steps or step % self.measure_every_n_steps == 0

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, *_: Any) -> None:
        step = trainer.global_step
        if self._pending is not None:
            self._pending.micro_batches += 1
            return
        if not self._due(step):
            return
        self._last_profiled_step = step
        self._profiled_steps += 1
        tensors = list(tensors_in(batch))
        sizes = [t.shape[0] for t in tensors if t.ndim > 0]
        if not sizes:
            self.cannot_measure("no tensor with a batch dimension in the batch; no batch-size advice.")
        elif len(set(sizes)) > 1:
            self.warn(
                f"batch tensors disagree on the batch size {sorted(set(sizes))}; scaling by the first, {sizes[0]}.",
                once=True,
            )
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        timed = True if self._timed is None else self._timed
        recorder = SavedTensorRecorder(pl_module, exclude=tensors, time_modules=timed)
        if recorder.compiled:
            whole = ROOT in recorder.compiled  # Lightning compiles the training step
            what = "the training step" if whole else ", ".join(f"`{n}`" for n in recorder.compiled)
            self.info(
                f"{what} runs under torch.compile; the profiler steps aside inside it, since a hook there would "
                "break the compiled graph and change what it saves. Its saved tensors are counted as a whole, "
                "without a per-module breakdown or checkpointing advice inside"
                + (", and without mixed-precision advice (autocast cannot be read there)." if whole else "."),
                once=True,
            )
        self._pending = _Pending(
            step, sizes[0] if sizes else 0, element_bytes(tensors), time.perf_counter(), recorder.__enter__()
        )

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        if self._pending is not None:
            self._pending.recorder.close()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        if self._pending is not None:
            self._pending.recorder.close()
            # Under gradient accumulation the optimizer step, and so its state, comes with a later batch.
            if trainer.global_step > self._pending.step:
                self._finish_step(trainer, pl_module, self._pending)
                self._pending = None
        if self._snapshot_path is not None and trainer.global_step >= self.snapshot_steps:
            self._dump_snapshot()

    def _finish_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", pending: _Pending) -> None:
        cuda = self._device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self._device)
        seconds = time.perf_counter() - pending.start
        report = pending.recorder.report()
        held = self._tracker.update(pending.step, pending.recorder.held())
        if report.uncounted:
            self.cannot_measure(
                f"{report.uncounted} saved tensors have no storage (sparse or wrapper subclasses) and are not counted."
            )
        state = model_state_bytes(pl_module.parameters(), trainer.optimizers, pl_module.buffers())
        self._last_step = pending.step
        allocator = AllocatorStats.read(self._device) if cuda else None
        self.last = StepMemory(
            state,
            pending.inputs_bytes,
            report,
            pending.batch_size,
            self._budget,
            seconds,
            pending.micro_batches,
            held.held_bytes,
            allocator,
            pl_module,
        )
        metrics: dict[str, float] = {
            **category_metrics(self.last),
            **{
                f"memory/activations/{name}": nbytes
                for name, nbytes in list(report.by_module.items())[: self.max_modules_shown]
            },
        }
        self.remedies = rank_remedies(self.last, self.top_k)
        self._timed = {r.target for r in self.remedies if r.target}
        largest = self.last.largest_batch()
        if largest is not None:
            metrics["memory/largest_batch"] = largest
        self.last_metrics = metrics
        if trainer.is_global_zero:
            log_scalars(trainer, metrics, pending.step)
        if held.leaking:
            assert held.first_step is not None
            finding = GraphLeakFinding(
                pending.step, held.held_bytes, held.step_bytes, held.first_step, tuple(graph_holders(pl_module))
            )
            if not self.findings:
                self.warn(finding.message)
            self.findings[:] = [finding]

    def _dump_snapshot(self) -> None:
        assert self._snapshot_path is not None
        with torch.cuda.device(self._device):
            torch.cuda.memory._dump_snapshot(self._snapshot_path)
        self._stop_snapshot()
        self.info(f"memory snapshot written to {self._snapshot_path}; open it at https://pytorch.org/memory_viz")

    def _stop_snapshot(self) -> None:
        if self._snapshot_path is not None:
            torch.cuda.memory._record_memory_history(enabled=None, device=self._device)
            self._snapshot_path = None

    def _release(self) -> None:
        if self._pending is not None:
            self._pending.recorder.close()
            self._pending = None
        self._stop_snapshot()

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._snapshot_path is not None:
            self._dump_snapshot()
        self._release()
        if self.last is None:  # this fit profiled no step (a relaunch with none left): the fit before's report stands
            return
        table = self.summary_markdown()
        if self.verbose:
            self.info(f"memory at the last profiled step\n{markdown_to_text(table)}")
        step = trainer.global_step
        log_text(trainer, "memory/report", table, step)
        picture = self.picture() if tensorboard_writers(trainer, "images") else None
        if picture is not None:
            log_image(trainer, "memory/saved_bytes_by_module", picture, step)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._release()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._release()

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())

    def summary_line(self) -> str:
        """One line for the end of fit: the last profiled step's state and saved activations, and the findings."""
        if self.last is None:
            return "no step profiled."
        last = self.last
        return (
            f"model state {format_bytes(last.state.total)}, saved activations "
            f"{format_bytes(last.activations.total_bytes)} per micro-batch of {last.batch_size}; "
            f"{len(self.findings) or 'no'} graph(s) outliving their step."
        )

    def summary_markdown(self) -> str:
        """The latest profiled step as markdown: categories, saved bytes per module, ranked advice, findings.

        No title of its own: where it goes names it (the panel ``diagnosis/MemoryTopologyProfiler``, the
        report's memory table, the demo's section)."""
        lines = []
        if self.last is None:
            lines.append("No step profiled yet.")
        else:
            lines += self._categories_markdown(self.last) + self._modules_markdown(self.last)
            lines += self._advice_markdown(self.last)
        lines += ["", "### Findings"]
        lines += [f"- step {f.step}: {f.message}" for f in self.findings] or ["- none: no graph outlived its step"]
        return "\n".join(lines)

    def _categories_markdown(self, last: StepMemory) -> list[str]:
        return [
            f"Step {self._last_step}, batch of {last.batch_size} (this rank, one micro-batch).",
            "",
            *category_markdown(last),
        ]

    def _modules_markdown(self, last: StepMemory) -> list[str]:
        total = last.activations.total_bytes or 1
        rows = [
            (f"`{name}`", f"{nbytes:,}", f"{100 * nbytes / total:.1f}%")
            for name, nbytes in list(last.activations.by_module.items())[: self.max_modules_shown]
        ]
        return [
            "",
            "### Saved for backward, by module",
            *markdown_table(("module", "bytes", "share"), rows, align="lrr"),
        ]

    def _advice_markdown(self, last: StepMemory) -> list[str]:
        if last.budget_bytes is None:
            budget = "No memory budget (pass `memory_budget_bytes` on CPU): no largest-batch advice."
        else:
            origin = (
                "memory_budget_bytes"
                if self.memory_budget_bytes is not None
                else f"the total memory of {self._device}, the default on CUDA; memory_budget_bytes sets another"
            )
            budget = (
                f"Budget {format_bytes(last.budget_bytes)} ({origin}): the largest batch that fits is "
                f"{last.largest_batch()} (fixed {format_bytes(last.fixed_bytes)}, "
                f"{format_bytes(last.scaling_bytes / max(last.batch_size, 1))} per example)."
            )
        # The notes are a sentence each: under the table, where they keep a line of their own in a terminal
        # rather than wrapping in a last column narrowed by the others.
        rows, notes = [], []
        for rank, r in enumerate(self.remedies, 1):
            what = f"{r.kind} of `{r.target}`" if r.target else r.kind
            extra = f"+{100 * r.extra_compute:.1f}% step time" if r.extra_compute is not None else ""
            batch = "" if r.largest_batch is None else f"{r.largest_batch}"
            rows.append((rank, what, format_bytes(r.bytes_freed), batch, extra))
            notes.append(f"- **{rank}**: {r.note}")
        headers = ("#", "remedy", "lowers the peak by", "largest batch after", "extra compute")
        return [
            "",
            "### Advice, the most bytes off the step's peak first, the cheapest first among equals",
            budget,
            "",
            *markdown_table(headers, rows, align="llrrr"),
            *([""] + notes if notes else []),
        ]

    def picture(self) -> np.ndarray | None:
        """Saved bytes per module of the latest profiled step as an ``(H, W, 3)`` uint8 bar chart.

        Drawn with matplotlib's Agg canvas, without pyplot, so the session's backend is left alone.
        Returns ``None`` when nothing was saved, or (with one notice) when matplotlib is missing.
        """
        if self.last is None or not self.last.activations.by_module:
            return None
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            self.info("the picture needs matplotlib (pip install matplotlib); skipped.", once=True)
            return None
        items = list(self.last.activations.by_module.items())[: self.max_modules_shown][::-1]
        scale, unit = byte_unit(max(nbytes for _, nbytes in items))
        fig = Figure(figsize=(8, 1.5 + 0.3 * len(items)), dpi=100)
        canvas = FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.barh([name for name, _ in items], [nbytes / scale for _, nbytes in items], color="tab:blue")
        ax.set_xlabel(f"saved for backward ({unit})")
        ax.set_title(
            f"Saved activations by module, step {self._last_step} "
            f"(total {format_bytes(self.last.activations.total_bytes)})"
        )
        fig.tight_layout()
        canvas.draw()
        return np.asarray(canvas.buffer_rgba())[..., :3].copy()
