"""Batch size and learning rate: which lr fits a new batch size, and what the batch costs.

Pure Python (no torch, no Lightning), so the advice can be had from numbers alone. Notation
(docs/science.md §4): B the effective batch in examples, η the lr, B̂ the measured gradient noise scale
(B_simple, McCandlish et al. 2018, Eq. 2.9), r = B_new/B_old.

- Noise-aware rule (McCandlish et al. 2018, Eq. 2.6; the AdaScale gain): the best lr at batch B is
  η_max/(1 + B̂/B), so η_new/η_old = (1 + B̂/B_old)/(1 + B̂/B_new) for SGD-like optimizers
  (with momentum μ it acts on η/(1 − μ), μ kept), and the square root of that for Adam-like ones
  (Malladi et al. 2022). Below B̂ it is ≈ r (Goyal et al. 2017) or ≈ √r; above B̂ it flattens.
- Classic rules, when no B̂ is measured: linear (SGD-like) and square root (Adam-like). They are the
  B̂ → ∞ limits of the noise-aware rule.
- Steps and examples to reach a given loss: S/S_min = 1 + B̂/B and E/E_min = 1 + B/B̂
  (McCandlish et al. 2018, §2.3); both are 2 at B = B̂, the batch where time and compute balance.

The rules assume the lr was tuned at the old batch: an lr far below the best one is limited by the
number of steps, not by noise, and then follows the linear rule whatever B̂ says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainvitals._validation import check_float, check_int
from trainvitals.text.markdown import markdown_table

FAMILIES = ("sgd", "adam", "unsure")
FAMILY_LABELS = {"sgd": "SGD-like", "adam": "Adam-like", "unsure": "unsure"}
RULES = ("noise-aware", "linear", "square-root", "none")
REDUCTIONS = ("mean", "sum", "unsure")
DEFAULT_MULTIPLES = (0.5, 2.0, 4.0, 8.0)
WARMUP_LR_RATIO = 2.0  # an lr rising more than this wants a warmup (Goyal et al. 2017)
LARGE_ADAM_RATIO = 4.0  # from this batch ratio κ (or 1/κ) on, Adam's β and ε matter as well

# Names along the class hierarchy; a subclass of Adam is Adam-like. Anything else is "unsure".
_SGD_LIKE = frozenset({"SGD", "FusedSGD"})
_ADAM_LIKE = frozenset(
    {
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "SparseAdam",
        "FusedAdam",
        "DeepSpeedCPUAdam",
        "Adam8bit",
        "AdamW8bit",
        "PagedAdam",
        "PagedAdamW",
    }
)

# A duplicated batch leaves a mean loss unchanged and doubles a sum: log2 of the ratio is the
# exponent k of loss ∝ B^k. Randomness drawn in the training step itself blurs it, hence the band.
_REDUCTION_EXPONENT_TOLERANCE = 0.4


def check_positive(name: str, value: float) -> float:
    """``value`` as a float; TypeError (not a number) or ValueError (not finite and > 0) naming ``name``."""
    return check_float(name, value, 0.0, low_open=True)


def check_positive_int(name: str, value: int) -> int:
    """``value`` as an int; TypeError (not an integer) or ValueError (< 1) naming ``name``."""
    return check_int(name, value, 1)


def validate_family(family: str) -> str:
    """``family`` if it is one of :data:`FAMILIES`, else ValueError naming ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"`family` must be one of {FAMILIES}, got {family!r}")
    return family


def validate_noise_scale(noise_scale: float | None) -> float | None:
    """``None`` or B̂ > 0 as a float (examples); ValueError naming ``noise_scale`` otherwise."""
    return check_float("noise_scale", noise_scale, 0.0, low_open=True, none_ok=True)


def validate_batch_sizes(name: str, batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Each entry an example count, as every count is checked (:func:`~trainvitals._validation.check_int`,
    in [1, 10**15]); TypeError (not a sequence of numbers) or ValueError naming ``name`` otherwise."""
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise TypeError(f"`{name}` must be a sequence of integers in [1, 10**15], got {batch_sizes!r}")
    return tuple(check_int(name, b, 1) for b in batch_sizes)  # type: ignore[misc]


def _validate_multiples(multiples: Sequence[float]) -> tuple[float, ...]:
    """Each multiple of the batch as a float, finite and > 0; TypeError or ValueError naming ``multiples``."""
    if isinstance(multiples, (str, bytes)) or not isinstance(multiples, Sequence):
        raise TypeError(f"`multiples` must be a sequence of finite numbers > 0, got {multiples!r}")
    return tuple(check_positive("multiples", m) for m in multiples)


def optimizer_family(optimizer_class: type | str) -> str:
    """``"sgd"``, ``"adam"`` or ``"unsure"`` for an optimizer class (its whole hierarchy) or class name.

    SGD-like: SGD with or without momentum/Nesterov. Adam-like: Adam, AdamW, Adamax, NAdam, RAdam,
    RMSprop (the optimizers the square-root rule was derived for, Malladi et al. 2022) and their
    fused / 8-bit versions. Any other (Adagrad, LBFGS, LAMB, LARS, Lion, Adafactor, ...) is
    ``"unsure"``: no rule is guessed for it.
    """
    names = [optimizer_class] if isinstance(optimizer_class, str) else [c.__name__ for c in optimizer_class.__mro__]
    for name in names:
        if name in _SGD_LIKE:
            return "sgd"
        if name in _ADAM_LIKE:
            return "adam"
    return "unsure"


def effective_batch_size(
    per_device_batch: int,
    devices: int = 1,
    nodes: int = 1,
    accumulate_grad_batches: int = 1,
    splits_batch: bool = False,
) -> int:
    """Examples per optimizer step (docs/science.md §4).

    Each data-parallel process (single device, DDP, FSDP, DeepSpeed) loads its own batch:
    ``per_device_batch × devices × nodes × accumulate_grad_batches``. ``torch.nn.DataParallel``
    (``splits_batch=True``) splits one loaded batch across the devices of a node, so ``devices``
    does not multiply: ``per_device_batch`` is then the loader's batch.

    Args:
        per_device_batch: examples in one micro-batch as the DataLoader yields it, ≥ 1.
        devices: data-parallel devices per node, ≥ 1.
        nodes: ≥ 1.
        accumulate_grad_batches: micro-batches per optimizer step, ≥ 1.
        splits_batch: True for ``torch.nn.DataParallel``.

    Raises:
        ValueError: naming the first argument that is not an integer ≥ 1.
    """
    check_positive_int("per_device_batch", per_device_batch)
    check_positive_int("devices", devices)
    check_positive_int("nodes", nodes)
    check_positive_int("accumulate_grad_batches", accumulate_grad_batches)
    replicas = nodes if splits_batch else devices * nodes
    return per_device_batch * replicas * accumulate_grad_batches


def rule_for(family: str, noise_scale: float | None) -> str:
    """The rule :func:`lr_ratio` applies: one of :data:`RULES`."""
    if validate_family(family) == "unsure":
        return "none"
    if noise_scale is not None:
        return "noise-aware"
    return "linear" if family == "sgd" else "square-root"


def lr_ratio(batch_old: float, batch_new: float, family: str, noise_scale: float | None = None) -> float | None:
    """η_new/η_old when the effective batch goes from ``batch_old`` to ``batch_new`` examples.

    With B̂ (``noise_scale``, examples) the gain g = (1 + B̂/B_old)/(1 + B̂/B_new) (McCandlish et al.
    2018, Eq. 2.6): g for SGD-like, √g for Adam-like (Malladi et al. 2022). Without B̂, the classic
    limits r and √r. ``None`` for an ``"unsure"`` family.

    Raises:
        ValueError: for a batch or ``noise_scale`` that is not finite and > 0, or an unknown ``family``.
    """
    b_old, b_new = check_positive("batch_old", batch_old), check_positive("batch_new", batch_new)
    rule = rule_for(family, validate_noise_scale(noise_scale))
    if rule == "none":
        return None
    gain = b_new / b_old if noise_scale is None else (1.0 + noise_scale / b_old) / (1.0 + noise_scale / b_new)
    return gain if family == "sgd" else math.sqrt(gain)


def steps_over_min(batch: float, noise_scale: float) -> float:
    """S/S_min = 1 + B̂/B: optimizer steps relative to the fewest possible (McCandlish et al. 2018, §2.3)."""
    return 1.0 + check_positive("noise_scale", noise_scale) / check_positive("batch", batch)


def examples_over_min(batch: float, noise_scale: float) -> float:
    """E/E_min = 1 + B/B̂: examples processed relative to the fewest possible (McCandlish et al. 2018, §2.3)."""
    return 1.0 + check_positive("batch", batch) / check_positive("noise_scale", noise_scale)


def doubling_bounds(batch: float, b_low: float, b_high: float = math.inf) -> tuple[float, float, float]:
    """What doubling the batch B → 2B costs and buys when only B̂ ∈ [b_low, b_high] is known (McCandlish et al.
    2018, §2.3: S = S_min(1 + B̂/B), E = E_min(1 + B/B̂)), each end on the safe side of the interval.

    Returns ``(extra_examples, saved_steps, sgd_gain)``: at most ``extra_examples`` more examples per unit of
    progress, (1 + 2B/B̂)/(1 + B/B̂) − 1 at B̂ = b_low; at least ``saved_steps`` fewer optimizer steps,
    1 − (1 + B̂/2B)/(1 + B̂/B) at B̂ = b_low; and the SGD lr gain (1 + B̂/B)/(1 + B̂/2B) at B̂ = b_low, the smaller
    of the interval's (×2, the linear rule, as B̂ → ∞; Adam-like: its square root). Shares, not percent.

    Raises:
        ValueError: if ``batch`` or ``b_low`` is not positive, or ``b_high < b_low``.
    """
    ratio = check_positive("batch", batch) / check_positive("b_low", b_low)
    if not b_high >= b_low:
        raise ValueError(f"`b_high` must be >= `b_low` ({b_low}), got {b_high}")
    extra = (1 + 2 * ratio) / (1 + ratio) - 1
    saved = 1 - (1 + 1 / (2 * ratio)) / (1 + 1 / ratio)
    gain = (1 + 1 / ratio) / (1 + 1 / (2 * ratio))
    return extra, saved, gain


def adam_square_root_adjustments(
    kappa: float, betas: tuple[float, float] | None, eps: float | None
) -> tuple[tuple[float, float] | None, float | None]:
    """β and ε of the square-root scaling rule for a batch κ times larger (Malladi et al. 2022, §4).

    The rule keeps Adam's SDE: η → √κ η, 1 − β → κ(1 − β), ε → ε/√κ. Returns ``(betas, eps)``
    (``None`` where not given); a β at or below 0 means κ is beyond the rule's reach.
    """
    new_betas = None if betas is None else (1.0 - kappa * (1.0 - betas[0]), 1.0 - kappa * (1.0 - betas[1]))
    new_eps = None if eps is None else eps / math.sqrt(kappa)
    return new_betas, new_eps


@dataclass(frozen=True)
class Suggestion:
    """The advice for one target batch size.

    Attributes:
        key: metric suffix, ``"x2"`` for a multiple of the current batch, ``"b1024"`` for a listed size.
        label: for tables, ``"×2 (128)"`` or ``"1024"``.
        batch_size: target effective batch, examples (a multiple may be fractional).
        lr_ratio: η_new/η_old, ``None`` for an unsure family.
        lr: suggested lr, ``None`` for an unsure family.
        steps_over_min, examples_over_min: S/S_min and E/E_min at the target, ``None`` without B̂.
        notes: warnings and adjustments, in words.
    """

    key: str
    label: str
    batch_size: float
    lr_ratio: float | None
    lr: float | None
    steps_over_min: float | None
    examples_over_min: float | None
    notes: tuple[str, ...]


@dataclass(frozen=True)
class LRAdvice:
    """What :func:`advise` says about one lr at one effective batch.

    Attributes:
        batch_size: current effective batch, examples.
        lr: current lr.
        family: one of :data:`FAMILIES`.
        noise_scale: B̂ in examples, or ``None``.
        rule: one of :data:`RULES`.
        steps_over_min, examples_over_min: at the current batch, ``None`` without B̂.
        balanced_batch: the batch where S/S_min = E/E_min (= B̂), ``None`` without B̂.
        suggestions: one per target batch, multiples first.
    """

    batch_size: float
    lr: float
    family: str
    noise_scale: float | None
    rule: str
    steps_over_min: float | None
    examples_over_min: float | None
    balanced_batch: float | None
    suggestions: tuple[Suggestion, ...]


def _notes(
    family: str,
    ratio: float | None,
    batch: float,
    noise_scale: float | None,
    betas: tuple[float, float] | None,
    eps: float | None,
) -> tuple[str, ...]:
    notes = []
    if noise_scale is not None and batch > noise_scale:
        notes.append(f"above B̂ ≈ {noise_scale:.4g}: more batch buys little; sweep the lr")
    if ratio is not None and ratio > WARMUP_LR_RATIO:
        notes.append(f"the lr rises {ratio:.3g}×: warm it up over the first steps (Goyal et al. 2017)")
    if family == "adam" and ratio is not None:
        kappa = ratio * ratio  # the batch ratio the square-root rule would see, the gain under B̂
        if max(kappa, 1.0 / kappa) >= LARGE_ADAM_RATIO:
            notes.append(_adam_note(kappa, betas, eps))
    return tuple(notes)


def _adam_note(kappa: float, betas: tuple[float, float] | None, eps: float | None) -> str:
    new_betas, new_eps = adam_square_root_adjustments(kappa, betas, eps)
    head = f"square-root rule at κ = {kappa:.3g} (Malladi et al. 2022): "
    if new_betas is None and new_eps is None:
        return head + "also set 1 − β → κ(1 − β) and ε → ε/√κ"
    parts = []
    if new_betas is not None and betas is not None:
        if min(new_betas) <= 0.0:
            return head + f"β would fall to {min(new_betas):.3g} ≤ 0: beyond the rule's reach; sweep the lr and β"
        parts += [f"β₁ {betas[0]:g} → {new_betas[0]:.4g}", f"β₂ {betas[1]:g} → {new_betas[1]:.4g}"]
    if new_eps is not None:
        parts.append(f"ε {eps:.3g} → {new_eps:.3g}")
    return head + ", ".join(parts)


def _target_label(multiple: float, batch: float) -> str:
    return f"×{multiple:g} ({batch:.4g})"


def advise(
    batch_size: float,
    lr: float,
    family: str,
    noise_scale: float | None = None,
    target_batch_sizes: Sequence[float] = (),
    multiples: Sequence[float] = DEFAULT_MULTIPLES,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
) -> LRAdvice:
    """The lr to use at other batch sizes, and the efficiency of this one (docs/science.md §4).

    Args:
        batch_size: current effective batch B, examples per optimizer step (> 0).
        lr: the lr η (> 0) to scale: the one you set, a scheduler's base lr (the suggestions are base lrs too: the
            rules are ratios, so a schedule scales them as it scales this one).
        family: ``"sgd"``, ``"adam"`` or ``"unsure"`` (see :func:`optimizer_family`).
        noise_scale: measured B̂ (B_simple) in examples; ``None`` for the classic rules.
        target_batch_sizes: further effective batches to advise on, examples.
        multiples: targets as multiples of ``batch_size``; default ×½, ×2, ×4, ×8 (those below one
            example are left out).
        betas, eps: the optimizer's (β₁, β₂) and ε, for the Adam-like β/ε adjustments.

    Returns:
        :class:`LRAdvice` with one :class:`Suggestion` per multiple, then per listed target.

    Raises:
        ValueError: naming ``batch_size``, ``lr``, ``family``, ``noise_scale``,
            ``target_batch_sizes``, ``multiples``, ``betas`` or ``eps`` when out of range
            (non-positive or non-finite numbers, a zero target, an unknown family, β outside [0, 1)).
    """
    batch = check_positive("batch_size", batch_size)
    lr = check_positive("lr", lr)
    rule = rule_for(family, validate_noise_scale(noise_scale))
    targets = validate_batch_sizes("target_batch_sizes", target_batch_sizes)
    scales = _validate_multiples(multiples)
    if betas is not None and not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"`betas` must be two numbers in [0, 1), got {betas!r}")
    if eps is not None and not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"`eps` must be a finite number >= 0, got {eps!r}")

    # A multiple that leaves less than one example has no batch to suggest an lr for.
    rows = [(f"x{m:g}", _target_label(m, batch * m), batch * m) for m in scales if batch * m >= 1]
    rows += [(f"b{t:g}", f"{t:g}", t) for t in targets]
    suggestions = []
    for key, label, target in rows:
        ratio = lr_ratio(batch, target, family, noise_scale)
        suggestions.append(
            Suggestion(
                key=key,
                label=label,
                batch_size=target,
                lr_ratio=ratio,
                lr=None if ratio is None else lr * ratio,
                steps_over_min=None if noise_scale is None else steps_over_min(target, noise_scale),
                examples_over_min=None if noise_scale is None else examples_over_min(target, noise_scale),
                notes=_notes(family, ratio, target, noise_scale, betas, eps),
            )
        )
    return LRAdvice(
        batch_size=batch,
        lr=lr,
        family=family,
        noise_scale=noise_scale,
        rule=rule,
        steps_over_min=None if noise_scale is None else steps_over_min(batch, noise_scale),
        examples_over_min=None if noise_scale is None else examples_over_min(batch, noise_scale),
        balanced_batch=noise_scale,
        suggestions=tuple(suggestions),
    )


def classify_loss_reduction(loss: float, loss_on_doubled_batch: float) -> str:
    """``"mean"``, ``"sum"`` or ``"unsure"`` from the loss of a batch and of that batch twice over.

    Concatenating a batch with itself leaves a mean-reduced loss unchanged (ratio 1) and doubles a
    summed one (ratio 2), exactly without dropout. With k = log2(ratio) the exponent of loss ∝ B^k,
    ``"mean"`` when |k| < 0.4, ``"sum"`` when |k − 1| < 0.4; a zero, non-finite or sign-changing pair,
    or anything between (a sum plus a batch-independent term), is ``"unsure"``.
    """
    if not (math.isfinite(loss) and math.isfinite(loss_on_doubled_batch)) or loss == 0.0:
        return "unsure"
    ratio = loss_on_doubled_batch / loss
    if ratio <= 0.0:
        return "unsure"
    k = math.log2(ratio)
    if abs(k) < _REDUCTION_EXPONENT_TOLERANCE:
        return "mean"
    if abs(k - 1.0) < _REDUCTION_EXPONENT_TOLERANCE:
        return "sum"
    return "unsure"


def loss_reduction_note(
    reduction: str,
    family: str,
    per_device_batch: int,
    lr: float,
    eps: float | None = None,
    terms: float | None = None,
    divisor: float | None = None,
    lr_said: str = "lr",
) -> str:
    """What a loss reduction means for an optimizer family (docs/science.md §4, "Loss reduction").

    A loss summed over N terms has N× the gradient of their mean: N = b, the examples of a device's
    micro-batch, for a per-example loss; b × tokens for a per-token one. One also divided by d (transformers'
    ``num_items_in_batch``) has N/d×. SGD's step is then that scale × lr; Adam divides the scale out except
    against ε, which it divides by the scale.

    Args:
        terms: N when known (:func:`~trainvitals.per_example.detect_loss_reduction`), a micro-batch's, on
            average over the micro-batches of an optimizer step; ``None``: not known, and no scale is said.
        divisor: d, what each micro-batch's loss divides its sum by (Lightning's division by
            ``accumulate_grad_batches`` left out); ``None``: nothing.
        lr_said: what ``lr`` is, as the note names it: ``"base lr"`` for a scheduler's, which the lr now is not.

    Raises:
        ValueError: for a ``reduction`` not in :data:`REDUCTIONS` or an unknown ``family``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}")
    validate_family(family)
    if reduction == "mean":
        return "mean-reduced loss: the suggestions apply as they are"
    if reduction == "unsure":
        return "loss reduction unclear (neither mean nor sum over the batch): check how the loss scales with the batch"
    b = per_device_batch
    per_device = (
        "the sum already scales the step with the per-device batch, so divide a suggested lr by b_new/b_old when "
        "the per-device batch changes"
    )
    if terms is None:
        what = "loss summed over the batch (its graph does not say over how many terms, nor what it divides them by)"
        if family == "sgd":
            return f"{what}: SGD's effective {lr_said} is {lr:.3g} times that unknown gradient scale; {per_device}"
        if family == "adam":
            return (
                f"{what}: Adam divides the gradient scale out, except against ε, which it divides by that unknown "
                "scale; the suggestions apply as they are"
            )
        return f"{what}; how this optimizer reacts is unknown"
    over = f"{b} examples" if terms == b else f"{_number(terms)} terms ({b} examples × {terms / b:.3g} each)"
    if divisor is not None:
        over += f" and divided by {_number(divisor)}"
    n = terms / divisor if divisor is not None else terms
    scale = _number(n)
    if family == "sgd":
        return (
            f"loss summed over {over}: the gradient is {scale}× that of their mean, so SGD steps with an effective "
            f"{lr_said} of {scale} × {lr:.3g} = {n * lr:.3g}; {per_device}"
        )
    if family == "adam":
        eps_part = f" = {eps / n:.3g}" if eps is not None else ""
        return (
            f"loss summed over {over}: Adam divides the {scale}× gradient scale out, except against ε: the "
            f"effective ε is ε/{scale}{eps_part}; the suggestions apply as they are"
        )
    return f"loss summed over {over}: the gradient is {scale}× that of their mean; how this optimizer reacts is unknown"


def _number(value: float) -> str:
    """A count as it is (``40``), another number to three digits (``0.309``)."""
    return f"{value:g}" if float(value).is_integer() else f"{value:.3g}"


def param_group_labels(class_names: Sequence[str], group_names: Sequence[Sequence[str | None]]) -> list[list[str]]:
    """Names for each optimizer's param groups, as Lightning's ``LearningRateMonitor`` makes them.

    The class name; ``-1``, ``-2`` for the second, third optimizer of a class; ``/pg1``, ``/pg2``
    (or the group's ``name``) when an optimizer has several groups, ``/name`` for a named single group.
    """
    seen: dict[str, int] = {}
    labels = []
    for cls, groups in zip(class_names, group_names):
        count = seen.get(cls, 0)
        seen[cls] = count + 1
        base = cls if count == 0 else f"{cls}-{count}"
        if len(groups) > 1:
            labels.append([f"{base}/{g or f'pg{i + 1}'}" for i, g in enumerate(groups)])
        else:
            labels.append([f"{base}/{groups[0]}" if groups and groups[0] else base])
    return labels


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def advice_table(advices: Mapping[str, LRAdvice]) -> str:
    """A markdown report of :func:`advise` results keyed by optimizer / param group name.

    One row per group with its family, base lr (the lr advised on), rule and the suggested lr at each target; a table of
    S/S_min and E/E_min per batch when B̂ is known; then the notes. Readable as plain text too.
    All advices should share the batch and B̂ (they come from one run).
    """
    if not advices:
        return "no optimizer to advise on"
    first = next(iter(advices.values()))
    labels = [s.label for s in first.suggestions]
    rows = []
    for name, adv in advices.items():
        lr_at = {s.label: s.lr for s in adv.suggestions}
        rows.append(
            [name, FAMILY_LABELS[adv.family], f"{adv.lr:.3g}", adv.rule, *(_fmt(lr_at.get(label)) for label in labels)]
        )
    lines = markdown_table(["optimizer", "family", "base lr", "rule", *labels], rows)
    if first.noise_scale is not None:
        steps = [first.steps_over_min] + [s.steps_over_min for s in first.suggestions]
        examples = [first.examples_over_min] + [s.examples_over_min for s in first.suggestions]
        lines += [
            "",
            *markdown_table(
                ["batch", f"{first.batch_size:.4g} (now)", *labels],
                [["steps S/S_min", *map(_fmt, steps)], ["examples E/E_min", *map(_fmt, examples)]],
            ),
        ]
    by_note: dict[tuple[str, str], list[str]] = {}  # one line per (target, note), naming the groups it is for
    for name, adv in advices.items():
        for s in adv.suggestions:
            for note in s.notes:
                by_note.setdefault((s.label, note), []).append(name)
    notes = [f"- {label} [{', '.join(names)}]: {note}" for (label, note), names in by_note.items()]
    if any(adv.family == "unsure" for adv in advices.values()):
        notes.append("- unsure: no scaling rule is known for this optimizer class; sweep the lr")
    if notes:
        lines += ["", "notes:"] + notes
    return "\n".join(lines)
