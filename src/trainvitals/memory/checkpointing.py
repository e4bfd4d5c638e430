"""Activation checkpointing arithmetic from one recorded forward: what it frees, what backward holds again."""

from __future__ import annotations

from trainvitals.memory.recorder import OUTSIDE, ROOT, SavedTensorReport


def _enclosing(name: str) -> list[str]:
    """``name`` and the modules around it, innermost first, ending with :data:`ROOT`."""
    if name in (ROOT, OUTSIDE):
        return [name]
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(len(parts), 0, -1)] + [ROOT]


def _innermost_common(savers: tuple[str, ...]) -> str:
    """The innermost module whose forward contains every saver (:data:`OUTSIDE` if one ran outside all)."""
    if OUTSIDE in savers:
        return OUTSIDE
    common = set(_enclosing(savers[0]))
    for saver in savers[1:]:
        common.intersection_update(_enclosing(saver))
    # The enclosing modules form a chain; the innermost is the deepest (ROOT, always common, the outermost).
    return max(common, key=lambda n: -1 if n == ROOT else n.count("."))


def checkpoint_savings(report: SavedTensorReport) -> dict[str, int]:
    """Bytes that activation checkpointing of each module would free, from one recorded forward.

    Checkpointing a module keeps its tensor arguments and recomputes everything saved inside it. A
    storage is freed when every op that saved it ran inside the module; one also saved outside (the
    module's output saved again by the next layer) stays. So, per module ``M``:

        savings(M) = bytes(saved only inside M) − bytes(M's inputs that were saved only inside M)
                     − bytes(M's inputs that were not saved at all)

    It is negative when the module is cheap to keep and its input is not otherwise saved
    (checkpointing an element-wise op alone). Excluded storages (batch, parameters) never count.

    Returns:
        Every module that ran a forward (qualified name, or :data:`ROOT`) → bytes freed.
    """
    owner = {key: _innermost_common(s.savers) for key, s in report.storages.items()}
    inside: dict[str, int] = {}
    for key, s in report.storages.items():
        if owner[key] != OUTSIDE:
            for name in _enclosing(owner[key]):
                inside[name] = inside.get(name, 0) + s.nbytes
    savings = {}
    for name, inputs in report.module_inputs.items():
        freed = inside.get(name, 0)
        for key in inputs:
            if key not in report.storages:
                freed -= report.input_nbytes[key]
            elif name in _enclosing(owner[key]):
                freed -= report.storages[key].nbytes
        savings[name] = freed
    return savings


def checkpoint_peak(report: SavedTensorReport, name: str) -> int:
    """Saved bytes held while backward recomputes module ``name``, were it checkpointed.

    A checkpointed module's saved tensors come back in backward, one call at a time, when its forward
    runs again: then what layers outside it saved before the call is still held (backward has not
    reached them; what they saved after it is released by then, and what the module's own other calls
    saved, checkpointing dropped), with the inputs the checkpoint keeps and everything the call saves
    (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", §3: the peak is the checkpoints
    plus one segment). Checkpointing the module that saves most of a model's activations in its first layers
    frees them after forward but not at this peak, so the step's peak hardly falls.

    Returns:
        Bytes at the costliest call, to compare with ``total_bytes`` − :func:`checkpoint_savings`.
    """
    inputs = report.module_inputs.get(name, frozenset())
    saves = {
        key: [(name in _enclosing(saver), index) for saver, index in zip(s.savers, s.saves)]
        for key, s in report.storages.items()
    }  # (saved inside the module, save index)

    def held(start: int, end: int) -> int:
        return sum(
            s.nbytes
            for key, s in report.storages.items()
            if (key in inputs and s.saves[0] < start)
            or any((not inside and index < start) or (inside and start <= index < end) for inside, index in saves[key])
        )

    peak = max((held(start, end) for start, end in report.module_calls.get(name, ((0, 0),))), default=0)
    return peak + sum(report.input_nbytes[key] for key in inputs if key not in report.storages)


def whole_forward_modules(report: SavedTensorReport) -> set[str]:
    """Modules that run the model's whole forward: the root's only module that ran, that one's only, ...

    Checkpointing one of them is checkpointing the model: it frees nearly everything for a second
    full forward, so :func:`rank_remedies` leaves them out, like the root.
    """
    ran = set(report.module_inputs) - {ROOT}
    children: dict[str, list[str]] = {}
    for name in ran:
        parent = next((n for n in _enclosing(name)[1:] if n in ran), ROOT)
        children.setdefault(parent, []).append(name)
    chain, current = set(), ROOT
    while len(children.get(current, ())) == 1:
        current = children[current][0]
        chain.add(current)
    return chain


def transformer_layer_activation_bytes(
    seq_len: int, batch: int, hidden: int, heads: int, float_bytes: int = 2, mask_bytes: int = 1
) -> int:
    """Activation bytes one transformer layer saves for backward (Korthikanti et al. 2022, §4.1, Eq. 1).

    The paper counts, per layer with sequence ``s``, batch ``b``, hidden size ``h``, ``a`` heads: the
    attention block (QKV input, Q, K, V, softmax output, its dropout mask and output, projection
    input, dropout mask), the MLP (both linear inputs, the GELU input, dropout mask) and two
    LayerNorm inputs. With ``p`` bytes per float and ``m`` per dropout-mask element:

        s·b·h·(16p + 2m) + a·s²·b·(2p + m)  bytes

    which is the paper's ``s·b·h·(34 + 5·a·s/h)`` for fp16 (p = 2, m = 1). In fp32 on CUDA use
    p = 4, m = 1; on CPU, where dropout multiplies by a float mask, m = p. LayerNorm's per-row mean
    and reciprocal std are left out, as in the paper.
    """
    s, b, h, a = seq_len, batch, hidden, heads
    return s * b * h * (16 * float_bytes + 2 * mask_bytes) + a * s * s * b * (2 * float_bytes + mask_bytes)
