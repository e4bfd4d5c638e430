"""Constructor arguments of every public class: bad types raise TypeError, bad values ValueError, both
naming the argument and what it accepts; good values are taken (an integral float as an int).

The arguments come from ``inspect.signature`` of each class in ``trainvitals.__all__``; :data:`SPECS`
says what each accepts, independently of the code, and a new argument without a spec fails
:func:`test_every_argument_has_a_spec`. Hypothesis draws with a fixed, derandomized budget.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainvitals
from trainvitals._validation import MAX_INT, check_float, check_int

BUDGET = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

_WEIRD = st.one_of(
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    st.complex_numbers(allow_nan=False, allow_infinity=False).filter(lambda z: z.imag != 0),
    st.just(object()),
    st.binary(max_size=2),
)


@dataclass(frozen=True)
class Spec:
    """What one argument accepts. ``kind``: bool, int, float, choice, callable, or a special one."""

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    allow_inf: bool = False
    none_ok: bool = False
    choices: tuple[str, ...] = ()
    context: dict[str, Any] = field(default_factory=dict)  # other arguments a valid draw needs


def Bool(none_ok: bool = False) -> Spec:
    return Spec("bool", none_ok=none_ok)


def Int(low: int, high: int = MAX_INT, none_ok: bool = False, **context: Any) -> Spec:
    return Spec("int", low, high, none_ok=none_ok, context=context)


def Float(low: float | None = None, high: float | None = None, **kw: Any) -> Spec:
    return Spec("float", low, high, **kw)


def Choice(*choices: str) -> Spec:
    return Spec("choice", choices=choices)


SPECS: dict[str, dict[str, Spec]] = {
    "GradNormMonitor": {
        "norm_type": Spec("norm_type"),
        "grouping": Choice("parameter", "module", "block"),
        "log_every_n_steps": Int(1, none_ok=True),
        "histogram_every_n_steps": Int(0),
        "spike_factor": Float(1.0, low_open=True),
        "ema_beta": Float(0.0, 1.0, high_open=True),
        "spike_warmup_steps": Int(0),
        "name_producer": Bool(),
        "producer_search": Choice("flags", "anomaly"),
    },
    "GradNormEarlyStopping": {
        "mode": Choice("noise_band", "threshold", "relative"),
        "margin": Float(0.0),
        "patience": Int(1),
        "min_steps": Int(0),
        "threshold": Float(0.0, low_open=True),
        "fraction": Float(0.0, 1.0, low_open=True, high_open=True),
        "reference_steps": Int(1),
        "ema_beta": Float(0.0, 1.0, high_open=True),
        "check_every_n_steps": Int(1),
        "verbose": Bool(),
        "min_loss_drop": Float(0.0, 1.0, high_open=True, none_ok=True),
        "hold_from_start": Bool(),
    },
    "BandSchedule": {
        "factor": Float(0.0, 1.0, low_open=True, high_open=True),
        "max_cuts": Int(0, none_ok=True),
        "min_lr": Float(0.0),
        "stop": Bool(),
        "grow_batch": Bool(),
        "warmup_steps": Int(0, none_ok=True),
        "margin": Float(0.0, low_open=True),
        "patience": Int(1),
        "min_steps": Int(0),
        "ema_beta": Float(0.0, 1.0, high_open=True),
        "check_every_n_steps": Int(1),
        "verbose": Bool(),
        "min_loss_drop": Float(0.0, 1.0, high_open=True, none_ok=True),
    },
    "BatchVarianceProbe": {
        "measure_every_n_steps": Int(1),
        "log_every_n_steps": Int(1, none_ok=True),
        "histogram_every_n_steps": Int(0),
        "ema_beta": Float(0.0, 1.0, high_open=True),
        "loss_reduction": Choice("auto", "mean", "sum"),
        "per_coordinate": Bool(),
        "coordinate_budget": Int(1),
        "fallback": Bool(),
        "fallback_sub_batch": Int(2),
        "max_rel_err": Float(0.0, low_open=True),
        "top_k": Int(0),
        "sequence_first": Bool(none_ok=True),
        "strict": Bool(),
    },
    "LRScalingAdvisor": {
        "log_every_n_steps": Int(1, none_ok=True),
        "target_batch_sizes": Spec("batch_sizes"),
        "reference": Spec("reference"),
        "noise_scale": Float(0.0, low_open=True, none_ok=True),
        "batch_size": Int(1, none_ok=True),
        "detect_loss_reduction": Bool(),
        "verbose": Bool(),
    },
    "GraphIntegrityCallback": {
        "check_every_n_steps": Int(1, dead_after_steps=1),
        "dead_after_steps": Int(1, 50),  # at most check_every_n_steps, 50 by default
        "detect_anomaly_steps": Int(0),
        "check_batch_independence": Bool(),
        "batch_input": Spec("callable", none_ok=True),
        "strict": Bool(),
        "verbose": Bool(),
    },
    "MemoryTopologyProfiler": {
        "measure_every_n_steps": Int(1),
        "first_steps": Int(0),
        "memory_budget_bytes": Int(1, none_ok=True),
        "top_k": Int(0),
        "snapshot_steps": Int(0),
        "max_modules_shown": Int(1),
        "strict": Bool(),
        "verbose": Bool(),
    },
    "TrainvitalsDashboard": {"progress_bar": Bool(), "diagnosis": Bool(), "report": Bool()},
    "UpdateMonitor": {
        "grouping": Choice("parameter", "module", "block"),
        "log_every_n_steps": Int(1, none_ok=True),
        "usual_ratio": Float(0.0, low_open=True),
        "ratio_factor": Float(1.0, low_open=True),
        "spike_factor": Float(1.0, low_open=True),
        "ema_beta": Float(0.0, 1.0, high_open=True),
        "spike_warmup_steps": Int(0),
    },
    "ActivationMonitor": {
        "measure_every_n_steps": Int(1, none_ok=True),
        "modules": Spec("callable", none_ok=True),
        "dead_share": Float(0.0, 1.0, high_open=True),
        "growth_factor": Float(1.0, low_open=True),
        "growth_steps": Int(1),
    },
    "TrainingGuard": {
        "on_nonfinite": Choice("warn", "skip", "rollback", "stop"),
        "on_spike": Choice("warn", "skip", "rollback", "stop"),
        "spike_factor": Float(1.0, low_open=True),
        "ema_beta": Float(0.0, 1.0, high_open=True),
        "spike_warmup_steps": Int(0),
        "snapshot_every_n_steps": Int(0),
        "snapshot_on": Choice("cpu", "device"),
        "lr_factor": Float(0.0, 1.0, low_open=True),
        "lr_factor_steps": Int(0),
        "budget_events": Int(1),
        "budget_window": Int(1),
        "name_producer": Bool(),
        "producer_search": Choice("flags", "anomaly"),
        "snapshot_in_checkpoint": Bool(),
    },
}

ARGUMENTS = [
    (cls, name) for cls in trainvitals.__all__ for name in inspect.signature(getattr(trainvitals, cls)).parameters
]


def test_every_argument_has_a_spec():
    assert {cls for cls, _ in ARGUMENTS} == set(SPECS)
    for cls in SPECS:
        assert set(inspect.signature(getattr(trainvitals, cls)).parameters) == set(SPECS[cls]), cls


# ------------------------------------------------------------------ what to draw
def _wrong_type(spec: Spec) -> st.SearchStrategy[Any]:
    """Values of a type the argument never takes: TypeError."""
    none = [] if spec.none_ok else [st.none()]
    if spec.kind == "bool":
        return st.one_of(st.integers(), st.floats(), st.text(max_size=3), _WEIRD, *none)
    if spec.kind in ("int", "float"):
        return st.one_of(st.booleans(), st.text(max_size=3), _WEIRD, *none)
    if spec.kind == "choice":
        return st.one_of(st.integers(), st.floats(), st.booleans(), _WEIRD, *none)
    if spec.kind == "callable":
        return st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
    if spec.kind == "norm_type":
        return st.one_of(st.booleans(), st.none(), _WEIRD)
    if spec.kind == "batch_sizes":
        return st.one_of(
            st.integers(),
            st.floats(),
            st.text(max_size=3),
            st.lists(st.text(min_size=1), min_size=1),
            st.lists(st.booleans(), min_size=1),
        )
    if spec.kind == "reference":
        return st.one_of(
            st.integers(),
            st.floats(),
            st.text(max_size=3),
            st.tuples(st.integers(1, 9)),
            st.tuples(st.integers(1, 9), st.floats(0.1, 1), st.integers()),
            st.tuples(st.text(max_size=2), st.floats(0.1, 1)),
            st.tuples(st.integers(1, 9), st.booleans()),
            st.tuples(st.integers(1, 9), st.dictionaries(st.integers(), st.floats(0.1, 1), min_size=1, max_size=2)),
        )
    raise AssertionError(spec.kind)


def _outside(spec: Spec) -> st.SearchStrategy[float]:
    """Finite floats outside the spec's interval."""
    parts = []
    if spec.low is not None:
        parts.append(
            st.floats(max_value=spec.low, exclude_max=not spec.low_open, allow_nan=False, allow_infinity=False)
        )
    if spec.high is not None:
        parts.append(
            st.floats(min_value=spec.high, exclude_min=not spec.high_open, allow_nan=False, allow_infinity=False)
        )
    return st.one_of(parts) if parts else st.nothing()


def _wrong_value(spec: Spec) -> st.SearchStrategy[Any]:
    """Values of an accepted type but out of range (NaN, an infinity, a fraction for a count): ValueError."""
    if spec.kind == "int":
        low, high = int(spec.low), int(min(spec.high, MAX_INT))
        return st.one_of(
            st.integers(max_value=low - 1),
            st.integers(min_value=high + 1),
            st.sampled_from([10**30, 10**400, -(10**30)]).filter(lambda v: not low <= v <= high),
            st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()),
            st.sampled_from([math.nan, math.inf, -math.inf]),
            st.integers(max_value=low - 1).map(float),
        )
    if spec.kind == "float":
        bad = [_outside(spec), st.just(math.nan), st.just(10**400 if spec.high is None else -(10**400))]
        if not spec.allow_inf:
            bad.append(st.sampled_from([math.inf, -math.inf]))
        return st.one_of(bad)
    if spec.kind == "choice":
        return st.text(max_size=8).filter(lambda s: s not in spec.choices)
    if spec.kind == "norm_type":
        return st.one_of(
            st.floats(max_value=0.0),
            st.just(math.nan),
            st.just(-math.inf),
            st.text(max_size=4).filter(lambda s: s.lower() != "inf"),
            st.sampled_from(["2", "l2"]),
        )
    if spec.kind == "batch_sizes":
        bad_count = st.one_of(
            st.floats(max_value=0.0),
            st.just(math.nan),
            st.just(math.inf),
            st.integers(max_value=0),
            st.sampled_from([2.5, 10**30, 1e300, MAX_INT + 1]),
        )
        return st.lists(bad_count, min_size=1, max_size=3).flatmap(lambda bad: st.permutations([64, *bad]))
    if spec.kind == "reference":
        return st.one_of(
            st.tuples(st.integers(max_value=0), st.floats(0.1, 1)),
            st.tuples(st.floats(1.1, 9.9).filter(lambda x: not x.is_integer()), st.floats(0.1, 1)),
            st.tuples(st.integers(1, 99), st.one_of(st.floats(max_value=0.0), st.just(math.nan))),
            st.tuples(
                st.integers(1, 99),
                st.dictionaries(st.text(max_size=3), st.floats(max_value=0.0), min_size=1, max_size=2),
            ),
            st.tuples(st.integers(1, 99), st.just({})),
        )
    return st.nothing()


def _valid(spec: Spec) -> st.SearchStrategy[Any]:
    none = [st.none()] if spec.none_ok else []
    if spec.kind == "bool":
        return st.one_of(st.booleans(), *none)
    if spec.kind == "int":
        ints = st.integers(int(spec.low), int(spec.high))
        return st.one_of(ints, ints.map(float), st.sampled_from([int(spec.low), int(spec.high)]), *none)
    if spec.kind == "float":
        floats = st.floats(
            spec.low,
            spec.high,
            exclude_min=spec.low_open,
            exclude_max=spec.high_open,
            allow_nan=False,
            allow_infinity=False,
        )
        return st.one_of(floats, *none)
    if spec.kind == "choice":
        return st.sampled_from(spec.choices)
    if spec.kind == "callable":
        return st.sampled_from([None, lambda batch: batch[0]])
    if spec.kind == "norm_type":
        return st.one_of(st.floats(min_value=0.0, exclude_min=True, allow_nan=False), st.just("inf"), st.integers(1, 9))
    if spec.kind == "batch_sizes":
        ints = st.integers(1, MAX_INT)
        return st.lists(st.one_of(ints, st.integers(1, 10**9).map(float)), max_size=3)
    if spec.kind == "reference":
        return st.tuples(
            st.integers(1, 10**6),
            st.one_of(st.floats(1e-9, 10.0), st.dictionaries(st.text(max_size=3), st.floats(1e-9, 1.0), min_size=1)),
        )
    raise AssertionError(spec.kind)


def _build(cls: str, name: str, value: Any) -> Any:
    spec = SPECS[cls][name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # nothing is deprecated before 1.0
        return getattr(trainvitals, cls)(**{**spec.context, name: value})


def _assert_message(err: Exception, name: str, spec: Spec) -> None:
    message = str(err)
    assert f"`{name}`" in message, message
    if spec.kind == "int":
        assert (
            f"[{int(spec.low)}, " in message and ("10**15" if spec.high >= MAX_INT else f"{int(spec.high)}]") in message
        ), message
    elif spec.kind == "float":
        for bound in (spec.low, spec.high):
            assert bound is None or f"{bound:g}" in message, message
    elif spec.kind == "choice":
        assert all(repr(c) in message for c in spec.choices), message
    elif spec.kind == "bool":
        assert "bool" in message, message
    if spec.none_ok and spec.kind in ("int", "float", "bool"):
        assert "or None" in message, message


def _check_refused(cls: str, name: str, value: Any, error: type[Exception]) -> None:
    spec = SPECS[cls][name]
    with pytest.raises(error) as info:
        _build(cls, name, value)
    assert type(info.value) is error, f"{cls}({name}={value!r}) raised {type(info.value).__name__}: {info.value}"
    _assert_message(info.value, name, spec)


@pytest.mark.parametrize(("cls", "name"), ARGUMENTS)
def test_wrong_type_is_a_type_error_naming_the_argument(cls, name):
    @BUDGET
    @given(_wrong_type(SPECS[cls][name]))
    def check(value):
        _check_refused(cls, name, value, TypeError)

    check()


@pytest.mark.parametrize(
    ("cls", "name"), [(c, n) for c, n in ARGUMENTS if SPECS[c][n].kind not in ("bool", "callable")]
)
def test_wrong_value_is_a_value_error_naming_the_argument(cls, name):
    @BUDGET
    @given(_wrong_value(SPECS[cls][name]))
    def check(value):
        _check_refused(cls, name, value, ValueError)

    check()


STORED_AS = {("BandSchedule", "warmup_steps"): "requested_warmup"}
"""Arguments kept under another attribute: BandSchedule's ``warmup_steps`` is the fit's warmup (read from the
scheduler unless given), the argument ``requested_warmup``."""


@pytest.mark.parametrize(("cls", "name"), ARGUMENTS)
def test_valid_values_are_taken(cls, name):
    spec = SPECS[cls][name]

    @BUDGET
    @given(_valid(spec))
    def check(value):
        instance = _build(cls, name, value)
        stored = getattr(instance, STORED_AS.get((cls, name), name))
        if spec.kind == "int" and value is not None:
            assert type(stored) is int and stored == value
        elif spec.kind == "float" and value is not None:
            assert type(stored) is float and stored == value
        elif spec.kind in ("bool", "choice") or value is None and spec.kind in ("int", "float"):
            assert stored is value or stored == value

    check()


# ------------------------------------------------------------------ the module itself
def test_integer_policy():
    assert check_int("n", 2.0, 1) == 2 and type(check_int("n", 2.0, 1)) is int
    assert check_int("n", MAX_INT, 0) == MAX_INT
    with pytest.raises(ValueError, match=r"`n` must be an integer in \[0, 10\*\*15\], got 1000000000000001"):
        check_int("n", MAX_INT + 1, 0)
    with pytest.raises(TypeError, match="`n` must be an integer in .* or None, got True"):
        check_int("n", True, 0, none_ok=True)


def test_float_policy():
    assert check_float("x", 10**30, 0.0) == 1e30  # a big int is a float, not an OverflowError later
    assert check_float("p", math.inf, 0.0, low_open=True, allow_inf=True) == math.inf
    with pytest.raises(ValueError, match=r"`x` must be a finite number in \[0, 1\), got 1.0"):
        check_float("x", 1.0, 0.0, 1.0, high_open=True)
    with pytest.raises(ValueError, match="`x` must be a finite number >= 0, got 1000"):
        check_float("x", 10**400, 0.0)


def test_cross_argument_range_names_the_argument():
    with pytest.raises(ValueError, match=r"`dead_after_steps` must be an integer in \[1, 2\], got 3"):
        trainvitals.GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=3)


def test_norm_type_inf_string():
    assert trainvitals.GradNormMonitor(norm_type="inf").norm_type == math.inf
    assert trainvitals.GradNormMonitor(norm_type="INF").norm_type == math.inf


# ------------------------------------------------------------------ one vocabulary, no old names before 1.0
REMOVED = [
    ("GradNormMonitor", "spike_ema_beta"),
    ("BatchVarianceProbe", "every_n_steps"),
    ("BatchVarianceProbe", "beta"),
    ("LRScalingAdvisor", "every_n_steps"),
    ("MemoryTopologyProfiler", "every_n_steps"),
]


@pytest.mark.parametrize(("cls", "old"), REMOVED)
def test_the_old_argument_names_are_refused(cls, old):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
        getattr(trainvitals, cls)(**{old: 4})


@pytest.mark.parametrize(
    ("cls", "key"),
    [
        (
            "GradNormMonitor",
            "GradNormMonitor{'norm_type': 2.0, 'grouping': 'module', 'spike_factor': 5.0, 'ema_beta': 0.98}",
        ),
        ("BatchVarianceProbe", "BatchVarianceProbe{'measure_every_n_steps': 1, 'ema_beta': 0.98}"),
        ("MemoryTopologyProfiler", "MemoryTopologyProfiler{'measure_every_n_steps': 50, 'first_steps': 3}"),
    ],
)
def test_state_keys_are_built_from_the_arguments_names(cls, key):
    assert getattr(trainvitals, cls)().state_key == key


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        ("GradNormEarlyStopping", {"patience": 30, "min_steps": 20, "margin": 1}),
        ("GradNormMonitor", {"spike_factor": 5}),
        ("BatchVarianceProbe", {"measure_every_n_steps": 10}),
        ("GraphIntegrityCallback", {"check_every_n_steps": 50}),
        ("MemoryTopologyProfiler", {"first_steps": 3}),
    ],
)
def test_equal_values_from_a_config_give_the_same_state_key(cls, kwargs):
    """A value accepted in another type (2.0 for 2, numpy scalars) keys the state as the value itself does:
    a resume from a config that spells it otherwise must find the callback's saved state."""
    spelled = {k: np.float64(v) if isinstance(v, int) else np.int64(v) for k, v in kwargs.items()}
    assert getattr(trainvitals, cls)(**spelled).state_key == getattr(trainvitals, cls)(**kwargs).state_key


def test_histogram_off_is_zero_everywhere_and_none_is_refused():
    assert trainvitals.GradNormMonitor(histogram_every_n_steps=0).histogram_every_n_steps == 0
    assert trainvitals.BatchVarianceProbe(histogram_every_n_steps=0).histogram_every_n_steps == 0
    for cls in (trainvitals.GradNormMonitor, trainvitals.BatchVarianceProbe):
        with pytest.raises(TypeError, match="`histogram_every_n_steps` must be an integer"):
            cls(histogram_every_n_steps=None)


def test_measure_and_log_cadences_have_one_name_each():
    """``log_every_n_steps`` wherever a callback logs on its own cadence; ``measure_every_n_steps`` wherever
    it measures every n steps; ``ema_beta`` for every EMA decay."""
    names = {cls: set(inspect.signature(getattr(trainvitals, cls)).parameters) for cls in trainvitals.__all__}
    assert not any({"every_n_steps", "beta", "spike_ema_beta"} & params for params in names.values())
    assert {cls for cls, params in names.items() if "log_every_n_steps" in params} == {
        "GradNormMonitor",
        "BatchVarianceProbe",
        "LRScalingAdvisor",
        "UpdateMonitor",
    }
    assert {cls for cls, params in names.items() if "measure_every_n_steps" in params} == {
        "BatchVarianceProbe",
        "MemoryTopologyProfiler",
        "ActivationMonitor",
    }
    assert {cls for cls, params in names.items() if "ema_beta" in params} == {
        "GradNormMonitor",
        "GradNormEarlyStopping",
        "BandSchedule",
        "BatchVarianceProbe",
        "UpdateMonitor",
        "TrainingGuard",
    }


# ------------------------------------------------------------------ no logger
def test_without_a_logger_each_callback_says_once_that_nothing_is_recorded(caplog):
    from _models import Regressor, loader, regression_data
    from conftest import trainer_kwargs
    from lightning.pytorch import Trainer

    from trainvitals.plumbing import writers as _writers

    _writers._notices.clear()  # the notices are once per process; earlier tests may have said them
    names = sorted(trainvitals.__all__)
    # BandSchedule acts on the noise band GradNormEarlyStopping stops on: not in one fit.
    fits = [[name for name in names if name != "BandSchedule"], ["BandSchedule"]]
    for _ in range(2):
        for group in fits:
            callbacks = [getattr(trainvitals, name)() for name in group]
            for callback in callbacks:  # quiet end-of-run tables
                if hasattr(callback, "verbose"):
                    callback.verbose = False
            with caplog.at_level("INFO"):
                Trainer(**trainer_kwargs(callbacks=callbacks, logger=False, max_steps=2)).fit(
                    Regressor(), loader(regression_data(), 8)
                )
    for name in names:
        said = [
            r.message for r in caplog.records if r.message.startswith(f"trainvitals {name}: the Trainer has no logger")
        ]
        assert len(said) == 1, (name, said)
        assert "none of its metrics are recorded" in said[0]


def test_the_largest_accepted_values_run_without_overflow():
    """10**30 for a number (a float then) and 10**15 for a count go through a fit: no OverflowError."""
    from _models import Regressor, loader, regression_data
    from conftest import trainer_kwargs
    from lightning.pytorch import Trainer

    stopper = trainvitals.GradNormEarlyStopping(
        margin=10**30, patience=MAX_INT, min_steps=0, check_every_n_steps=1, verbose=False
    )
    probe = trainvitals.BatchVarianceProbe(max_rel_err=10**30, top_k=MAX_INT, histogram_every_n_steps=1)
    profiler = trainvitals.MemoryTopologyProfiler(
        top_k=2.0, max_modules_shown=MAX_INT, measure_every_n_steps=1, verbose=False
    )
    monitor = trainvitals.GradNormMonitor(spike_factor=10**30, spike_warmup_steps=MAX_INT, log_every_n_steps=MAX_INT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the stopper says it cannot stop in 4 steps
        trainer = Trainer(
            **trainer_kwargs(callbacks=[monitor, stopper, probe, profiler], max_steps=4, accumulate_grad_batches=2)
        )
        trainer.fit(Regressor(), loader(regression_data(), 8))
    assert trainer.global_step == 4 and stopper.steps == 4 and stopper.stopped_step is None
    assert int(probe.noise.count) == 4 and profiler.top_k == 2


def test_an_integer_too_long_to_print_is_still_named():
    with pytest.raises(ValueError, match=r"`patience` must be an integer in \[1, 10\*\*15\], got an integer of"):
        trainvitals.GradNormEarlyStopping(patience=10**5000)
    with pytest.raises(ValueError, match="`margin` must be a finite number >= 0"):
        trainvitals.GradNormEarlyStopping(margin=10**5000)


def test_target_batch_sizes_are_counts() -> None:
    """Each target is an example count as every count is: 2.5, 10**30 and 1e300 are refused, 2.0 is 2."""
    for bad in ([2.5], [64, 10**30], [1e300]):
        with pytest.raises(ValueError, match=r"^`target_batch_sizes` must be an integer in \[1, 10\*\*15\], got "):
            trainvitals.LRScalingAdvisor(target_batch_sizes=bad)
    sizes = trainvitals.LRScalingAdvisor(target_batch_sizes=[2.0, 128]).target_batch_sizes
    assert sizes == (2, 128) and all(type(b) is int for b in sizes)


def test_a_reference_mapping_is_non_empty_with_str_names() -> None:
    with pytest.raises(ValueError, match="non-empty mapping"):
        trainvitals.LRScalingAdvisor(reference=(64, {}))
    with pytest.raises(TypeError, match=r"group name \(str\)"):
        trainvitals.LRScalingAdvisor(reference=(64, {3: 0.1}))
