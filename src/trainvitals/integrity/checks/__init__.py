"""GraphIntegrityCallback's checks: one file each (or with its closest relatives), one class per check.

A check is a :class:`~trainvitals.integrity.checks.base.Check` subclass registered with
``@register_check(order=...)``; the finding kinds it files, with what the report makes of them, are
declared beside it (:class:`~trainvitals.integrity.findings.FindingKind`). Every module of this package is
imported here, so a new file is all a new check needs: the callback runs it, in its order, and
``trainvitals report`` reads its kinds. :func:`registered_checks` lists them; each module's docstring says
what its check finds.
"""

from importlib import import_module
from pkgutil import iter_modules

from trainvitals.integrity.checks.base import (
    Check,
    Fit,
    finding_kind,
    finding_kinds,
    register_check,
    registered_checks,
    unregister_check,
    window_labels,
)

for _module in sorted(m.name for m in iter_modules(__path__)):
    import_module(f"{__name__}.{_module}")  # each registers its checks

__all__ = [
    "Check",
    "Fit",
    "finding_kind",
    "finding_kinds",
    "register_check",
    "registered_checks",
    "unregister_check",
    "window_labels",
]
