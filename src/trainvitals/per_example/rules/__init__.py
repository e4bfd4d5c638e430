"""The built-in per-example rules, one file a layer family. Every module of this package is imported here, and
each registers its rules on import (:func:`~trainvitals.per_example.registry.register_per_example_rule`), so
a new family is one new file."""

from importlib import import_module
from pkgutil import iter_modules

for _module in sorted(m.name for m in iter_modules(__path__)):
    import_module(f"{__name__}.{_module}")  # each registers its rules
