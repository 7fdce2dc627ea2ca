"""What a weights load would do, decided before anything is written: entries loaded, target
variables the source lacks (missing), source entries with no variable (unexpected), shapes
that differ, dtype casts, and what ``keep_initial`` leaves alone.

>>> report = LoadReport(loaded=("fc/kernel",), missing=("head/kernel",), mismatched=(("fc/bias", (3,), (2,)),))
>>> print(report.problems())
['missing from the source: head/kernel', 'fc/bias: shape (3,) in the source (as stored), (2,) in the model']
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np

from trainkit.core.tree import Shape


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """Names are the model's (``Dense_0/kernel``; other collections prefixed:
    ``batch_stats/bn/mean``) except ``unexpected`` and ``ignored``, which are the source's own.

    Attributes:
        loaded: variables the source fills.
        missing: variables the source has nothing for.
        unexpected: source entries that fill no variable.
        mismatched: ``(variable, source shape, model shape)``, the source's shape as stored.
        casts: ``(variable, source dtype, model dtype)`` of loaded entries of another dtype.
        lossy: the casts that lose values (a narrower float, float to integer).
        kept_initial: variables ``keep_initial`` left at their initial values.
        ignored: source entries the layout has no place for (torch's ``num_batches_tracked``).
        hint: a rename that would match the names, when one prefix explains them (or, under
            ``layout="torch"``, ``as_is`` for weights that fit as stored).
        transposed_square: square 2-D source entries ``layout="torch"`` transposed: their shape
            cannot tell whether they are ``(out, in)`` (then right) or ``(in, out)`` (pass ``as_is``).
        non_finite: loaded variables holding a NaN or an infinity (loaded, and said).
    """

    loaded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, Shape, Shape], ...] = ()
    casts: tuple[tuple[str, str, str], ...] = ()
    lossy: tuple[str, ...] = ()
    kept_initial: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    hint: str = ""
    transposed_square: tuple[str, ...] = ()
    non_finite: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        """What ``strict=True`` refuses, one line each."""
        lines = [f"missing from the source: {name}" for name in self.missing]
        lines += [f"not in the model: {name}" for name in self.unexpected]
        shapes = self.mismatched
        lines += [f"{name}: shape {src} in the source (as stored), {dst} in the model" for name, src, dst in shapes]
        casts = {name: (src, dst) for name, src, dst in self.casts}
        lines += [f"{name}: {casts[name][0]} in the source loses values as {casts[name][1]}" for name in self.lossy]
        return lines

    def __str__(self) -> str:
        parts = [f"loaded {len(self.loaded)} variables"]
        for label, names in (("kept at their initial values", self.kept_initial), ("ignored", self.ignored)):
            if names:
                parts.append(f"{label}: {', '.join(names)}")
        if self.casts:
            parts.append("cast: " + ", ".join(f"{name} {src}->{dst}" for name, src, dst in self.casts))
        if self.non_finite:
            parts.append("holding NaN or Inf (loaded as they are): " + ", ".join(self.non_finite))
        if self.transposed_square:
            parts.append(
                "transposed as (out, in), which their square shapes cannot confirm (check them, or as_is=[...]): "
                + ", ".join(self.transposed_square)
            )
        return "; ".join(parts + self.problems()) + (f". {self.hint}" if self.hint else "")


def loses_values(source: np.dtype, target: np.dtype) -> bool:
    """Whether casting ``source`` to ``target`` can change a value: a float of fewer mantissa or
    exponent bits, a float to an integer, an integer wider than the target holds exactly.

    >>> f32, bf16 = np.dtype("float32"), np.dtype(ml_dtypes.bfloat16)
    >>> loses_values(f32, bf16), loses_values(bf16, f32)
    (True, False)
    """
    if source == target:
        return False
    floats = jax.dtypes.issubdtype(source, np.floating), jax.dtypes.issubdtype(target, np.floating)
    if floats == (True, True):
        src, dst = ml_dtypes.finfo(source), ml_dtypes.finfo(target)
        return dst.nmant < src.nmant or dst.maxexp < src.maxexp
    if floats == (True, False):
        return True
    if floats == (False, True):
        return np.iinfo(source).bits - 1 > ml_dtypes.finfo(target).nmant + 1 if source != np.bool_ else False
    return not np.can_cast(source, target, casting="safe")
