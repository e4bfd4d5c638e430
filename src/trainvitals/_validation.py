"""Constructor-argument checks shared by every public class: one policy, one wording.

Pure Python (no torch, no Lightning), so ``core`` can use it too. The policy:

- a flag is a ``bool`` (``1``, ``"yes"``, NaN are refused);
- an integer is an ``int`` (or NumPy integer), or an integral float such as ``2.0`` read from a
  config file, returned as ``int``; at most :data:`MAX_INT` (a count of steps, examples or bytes
  beyond it is a typo, and would overflow the int64 tensors it is compared with);
- a number is an ``int`` or ``float``, returned as ``float``; NaN is always refused, ±inf unless
  the argument says it takes it;
- a choice is one of a few strings.

A value of the wrong type raises ``TypeError``, one of the right type out of range ``ValueError``;
both messages name the argument and what it accepts: "`patience` must be an integer in [1, 10**15],
got 0.5". ``None`` is accepted only where an argument's "or None" says what it means.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

MAX_INT = 10**15
_MAX_INT_TEXT = "10**15"


def _got(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's 4300-digit limit for str()
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(error: type[Exception], name: str, accepts: str, value: Any, none_ok: bool) -> Exception:
    return error(f"`{name}` must be {accepts}{' or None' if none_ok else ''}, got {_got(value)}")


def check_bool(name: str, value: Any, none_ok: bool = False) -> bool | None:
    """``value`` if it is ``True`` or ``False`` (or ``None`` when ``none_ok``); TypeError naming ``name`` otherwise."""
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        raise _refuse(TypeError, name, "a bool (True or False)", value, none_ok)
    return value


def check_int(name: str, value: Any, low: int, high: int = MAX_INT, none_ok: bool = False) -> int | None:
    """``value`` as an ``int`` in ``[low, high]`` (``high`` at most :data:`MAX_INT`).

    An integral float (``2.0``) is taken as that integer; ``None`` passes when ``none_ok``.

    Raises:
        TypeError: not an integer or a float (a bool, a string, a list).
        ValueError: a fractional, NaN or infinite float, or an integer out of range.
    """
    if value is None and none_ok:
        return None
    high = min(high, MAX_INT)
    accepts = f"an integer in [{low}, {_MAX_INT_TEXT if high == MAX_INT else high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refuse(TypeError, name, accepts, value, none_ok)
    if not isinstance(value, numbers.Integral):
        x = float(value)
        if not (math.isfinite(x) and x.is_integer()):
            raise _refuse(ValueError, name, accepts, value, none_ok)
    number = int(value)
    if not low <= number <= high:
        raise _refuse(ValueError, name, accepts, value, none_ok)
    return number


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def check_float(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
    none_ok: bool = False,
) -> float | None:
    """``value`` as a ``float`` in the interval given by ``low``/``high`` (open ends with ``*_open``).

    NaN is refused always; ±inf unless ``allow_inf`` (and then only if the interval holds it).

    Raises:
        TypeError: not a real number (a bool, a string, a complex, a list).
        ValueError: NaN, an infinity not allowed, too large for a float, or out of range.
    """
    if value is None and none_ok:
        return None
    interval = _interval(low, high, low_open, high_open)
    accepts = ("a number" if allow_inf else "a finite number") + (f" {interval}" if interval else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refuse(TypeError, name, accepts, value, none_ok)
    try:
        x = float(value)
    except OverflowError:  # an int beyond 1.8e308
        raise _refuse(ValueError, name, accepts, value, none_ok) from None
    if math.isnan(x) or (math.isinf(x) and not allow_inf):
        raise _refuse(ValueError, name, accepts, value, none_ok)
    if low is not None and (x < low or (low_open and x == low)):
        raise _refuse(ValueError, name, accepts, value, none_ok)
    if high is not None and (x > high or (high_open and x == high)):
        raise _refuse(ValueError, name, accepts, value, none_ok)
    return x


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``choices``; TypeError (not a string) or ValueError otherwise."""
    accepts = f"one of {tuple(choices)}"
    if not isinstance(value, str):
        raise _refuse(TypeError, name, accepts, value, False)
    if value not in choices:
        raise _refuse(ValueError, name, accepts, value, False)
    return value


def check_callable(name: str, value: Any, none_ok: bool = False) -> Callable[..., Any] | None:
    """``value`` if it is callable (or ``None`` when ``none_ok``); TypeError naming ``name`` otherwise."""
    if value is None and none_ok:
        return None
    if not callable(value):
        raise _refuse(TypeError, name, "callable", value, none_ok)
    return value
