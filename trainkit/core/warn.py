"""trainkit's warnings, shown at the user's line: the first caller outside trainkit (and the
JAX, Flax and optax code it calls back through), not a line of trainkit's own that a user
neither wrote nor can filter on. A hand-counted ``stacklevel`` points wrong as soon as a call
moves one function deeper; this one is found on each call.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     warn_user("the loss is nan")
>>> caught[0].filename == __file__ or caught[0].filename.startswith("<doctest")
True
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import flax
import jax
import optax

_TRAINKIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: files whose frames are passed over: trainkit's, and those it calls user code back through
_PASSED_OVER = (_TRAINKIT, os.path.abspath(contextlib.__file__)) + tuple(
    os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep for module in (jax, flax, optax)
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside trainkit (and
    JAX, Flax, optax and ``contextlib``); to the outermost frame where every frame is theirs (a
    background thread)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PASSED_OVER):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
