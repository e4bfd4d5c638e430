"""Which of a model's modules run under ``torch.compile``: a hook inside them would break or recompile the
compiled graphs (the memory recorder and the noise probe hook around them; the integrity checks' global module hook
stays off). Torch only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

ROOT = "(root)"
"""Label of the root module's own forward (ops not inside any child module)."""


def _dynamo_compiled(fn: Any) -> bool:
    """``fn`` is a function wrapped by ``torch.compile`` (its frame runs compiled)."""
    return hasattr(fn, "_torchdynamo_orig_callable")


def compiled_modules(module: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """The outermost modules of ``module`` whose calls run under ``torch.compile``, and the modules that
    can be hooked without breaking a compiled graph (in ``named_modules`` order).

    A module's forward is compiled (a ``torch.compile(m)`` wrapper, or what Lightning does to a compiled
    LightningModule): its submodules run compiled, its own hooks do not. Its whole call is compiled
    (``m.compile()``; the root whose ``training_step`` is compiled, as Lightning does): it too runs
    compiled. Names are qualified names, :data:`ROOT` for ``module``.
    """
    compiled: list[str] = []
    hooked: list[nn.Module] = []
    for name, m in module.named_modules():
        label = name or ROOT
        if any(c == ROOT or label.startswith(c + ".") for c in compiled):
            continue
        whole = getattr(m, "_compiled_call_impl", None) is not None or (
            m is module and _dynamo_compiled(getattr(m, "training_step", None))
        )
        if whole or _dynamo_compiled(getattr(m, "forward", None)):
            compiled.append(label)
        if not whole:
            hooked.append(m)
    return compiled, hooked
