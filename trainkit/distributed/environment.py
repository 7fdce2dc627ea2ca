"""trainkit's numeric environment settings (``TRAINKIT_STALL_TIMEOUT``, ``TRAINKIT_HEARTBEAT_TIMEOUT``,
``TRAINKIT_GATHER_TIMEOUT``), read with an error that names the variable and what it holds:
``float("10s")`` alone says ``could not convert string to float`` and names nothing.

>>> import os
>>> os.environ["TRAINKIT_EXAMPLE_TIMEOUT"] = "90"
>>> seconds("TRAINKIT_EXAMPLE_TIMEOUT", 60.0)
90.0
>>> seconds("TRAINKIT_UNSET_TIMEOUT", 60.0)
60.0
>>> del os.environ["TRAINKIT_EXAMPLE_TIMEOUT"]
"""

from __future__ import annotations

import math
import os


def seconds(name: str, default: float) -> float:
    """The positive number of seconds the environment variable ``name`` holds, else ``default``;
    a ``ValueError`` naming the variable for anything else (``"10s"``, ``"0"``, ``"-1"``)."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return float(default)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(
            f"{name}={text!r} is not a number of seconds: set it to a positive number (e.g. {name}={default:g}) "
            "or unset it for the default."
        )
    return value
