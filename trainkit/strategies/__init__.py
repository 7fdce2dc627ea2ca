"""Strategies: where the state and batches live and how steps are compiled."""

from __future__ import annotations

from collections.abc import Callable

import jax

from trainkit.strategies.auto import Auto
from trainkit.strategies.base import Strategy, check_steps_per_execution, make_mesh
from trainkit.strategies.data_parallel import DataParallel
from trainkit.strategies.fsdp import FSDP
from trainkit.strategies.hybrid import Hybrid
from trainkit.strategies.sharded import ShardedStrategy, SingleDevice

__all__ = [
    "Auto",
    "Strategy",
    "ShardedStrategy",
    "SingleDevice",
    "DataParallel",
    "FSDP",
    "Hybrid",
    "make_mesh",
    "check_steps_per_execution",
    "resolve_strategy",
]

_NAMES: dict[str, Callable[[], Strategy]] = {
    "single": SingleDevice,
    "single_device": SingleDevice,
    "data_parallel": DataParallel,
    "dp": DataParallel,
    "fsdp": FSDP,
}


def resolve_strategy(strategy: str | Strategy | Auto) -> Strategy | Auto:
    """A strategy object from an instance, a name, or ``"auto"``.

    ``"auto"`` is :class:`SingleDevice` on one device, else an :class:`Auto` choice that the
    Trainer makes from its compiled plan when it first sees data.

    >>> isinstance(resolve_strategy("single"), SingleDevice)
    True
    """
    if isinstance(strategy, (Strategy, Auto)):
        return strategy
    if strategy == "auto":
        return Auto() if jax.device_count() > 1 else SingleDevice()
    if isinstance(strategy, str) and strategy in _NAMES:
        return _NAMES[strategy]()
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise TypeError(f"Pass a strategy instance, e.g. {strategy.__name__}(), not the class.")
    raise ValueError(
        f"Unknown strategy {strategy!r}. Pass 'auto', one of {sorted(_NAMES)}, or an instance "
        "such as trainkit.DataParallel() or a subclass of trainkit.Strategy."
    )
