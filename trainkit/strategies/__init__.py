"""Strategies: where the state and batches live and how steps are compiled."""

from __future__ import annotations

import jax

from trainkit.strategies.base import SingleDevice, Strategy, make_mesh
from trainkit.strategies.data_parallel import DataParallel

__all__ = ["Strategy", "SingleDevice", "DataParallel", "make_mesh", "resolve_strategy"]

_NAMES = {"single": SingleDevice, "single_device": SingleDevice, "data_parallel": DataParallel, "dp": DataParallel}


def resolve_strategy(strategy: "str | Strategy") -> Strategy:
    """A strategy object from an instance, a name, or ``"auto"``.

    ``"auto"`` picks :class:`DataParallel` when more than one local device exists, else
    :class:`SingleDevice`.

    >>> isinstance(resolve_strategy("single"), SingleDevice)
    True
    """
    if isinstance(strategy, Strategy):
        return strategy
    if strategy == "auto":
        return DataParallel() if len(jax.local_devices()) > 1 else SingleDevice()
    if isinstance(strategy, str) and strategy in _NAMES:
        return _NAMES[strategy]()
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise TypeError(f"Pass a strategy instance, e.g. {strategy.__name__}(), not the class.")
    raise ValueError(
        f"Unknown strategy {strategy!r}. Pass 'auto', one of {sorted(_NAMES)}, or an instance "
        "such as trainkit.DataParallel() or a subclass of trainkit.Strategy."
    )
