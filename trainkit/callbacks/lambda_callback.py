"""``LambdaCallback``: a callback built from plain functions, with Keras 3's arguments.

>>> seen = []
>>> callback = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch), note="mine")
>>> callback.on_epoch_end(3, {}); seen, callback.note
([3], 'mine')
"""

from __future__ import annotations

from collections.abc import Callable

from trainkit.callbacks.base import HOOKS, Callback


class LambdaCallback(Callback):
    """Each given hook is a function with that hook's arguments (``on_train_begin=lambda logs:
    ...``, ``on_epoch_end=lambda epoch, logs: ...``, ``on_train_batch_end=lambda batch, logs:
    ...``). Other keywords become attributes, as in Keras."""

    def __init__(
        self,
        on_epoch_begin: Callable[..., object] | None = None,
        on_epoch_end: Callable[..., object] | None = None,
        on_train_begin: Callable[..., object] | None = None,
        on_train_end: Callable[..., object] | None = None,
        on_train_batch_begin: Callable[..., object] | None = None,
        on_train_batch_end: Callable[..., object] | None = None,
        **kwargs,
    ):
        self.__dict__.update(kwargs)
        given = {
            "on_epoch_begin": on_epoch_begin,
            "on_epoch_end": on_epoch_end,
            "on_train_begin": on_train_begin,
            "on_train_end": on_train_end,
            "on_train_batch_begin": on_train_batch_begin,
            "on_train_batch_end": on_train_batch_end,
        }
        for name, fn in given.items():
            if fn is not None:
                setattr(self, name, fn)
        for name, value in kwargs.items():
            if name.startswith("on_") and name not in (*HOOKS, "on_batch_begin", "on_batch_end"):
                raise ValueError(f"LambdaCallback: unknown hook {name!r}; hooks are {', '.join(HOOKS)}.")
            if name.startswith("on_") and not callable(value):
                raise TypeError(f"LambdaCallback: {name} must be a function; received {value!r}.")
