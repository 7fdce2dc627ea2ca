"""``"auto"``'s pick remembered across runs, next to the compilation cache.

A decision is stored under a key of everything that decides it (the model's state shapes, the
batch, the step's settings, the devices, the candidates, the versions), so the next run of the
same script picks the same strategy at once, without compiling or timing the candidates: runs
repeat, and a warm start costs what an explicit strategy costs. Off with the compilation cache
(``TRAINKIT_COMPILATION_CACHE=off``); delete the file (its path is logged) to plan again.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> key = decision_key({"model": "MLP", "batch": 32})
>>> remember(folder, key, "FSDP(fsdp=8)", "picked FSDP(fsdp=8): measured 1 ms/step")
>>> recall(folder, key)["strategy"]
'FSDP(fsdp=8)'
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TypedDict, TypeGuard

from trainkit.distributed import atomic

logger = logging.getLogger("trainkit")

SUBDIRECTORY = "trainkit-auto"


class Decision(TypedDict):
    """A stored ``"auto"`` decision, as :func:`remember` writes it."""

    strategy: str  # the pick's short name
    reason: str
    initialised_under: str | None  # the candidate whose initialisation built the state (None: the pick's own)
    compare_from_steps: float | None  # runs of this many steps or more compare the candidates left uncompiled


def decision_key(facts: dict[str, object]) -> str:
    """A stable hash of the facts a decision depends on (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def path_for(directory: str, key: str) -> str:
    return os.path.join(directory, SUBDIRECTORY, f"{key}.json")


def recall(directory: str | None, key: str, run_steps: int | None = None) -> Decision | None:
    """The decision stored under ``key`` (``{"strategy": short name, "reason": ...,
    "initialised_under": short name or None, "compare_from_steps": number or None}``), or
    ``None``: none stored, no directory, an unreadable file, or a decision that left
    candidates uncompiled which a run of ``run_steps`` steps (``None``: unknown) would
    compare (then planned again)."""
    if directory is None:
        return None
    try:
        with open(path_for(directory, key)) as file:
            read = json.load(file)
    except (OSError, ValueError):
        return None
    if not well_formed(read):
        return None
    decision = read
    compare_from = decision.get("compare_from_steps")
    if compare_from is not None and (run_steps is None or run_steps >= compare_from):
        return None
    return decision


def well_formed(decision: object) -> TypeGuard[Decision]:
    """Whether a stored decision has the fields and types this version writes (anything else,
    a hand-edited or truncated file, means: plan again).

    >>> well_formed({"strategy": "FSDP(fsdp=8)", "initialised_under": ["x"]})
    False
    """
    if not isinstance(decision, dict) or not all(isinstance(decision.get(k), str) for k in ("strategy", "reason")):
        return False
    under, compare_from = decision.get("initialised_under"), decision.get("compare_from_steps")
    number = isinstance(compare_from, (int, float)) and not isinstance(compare_from, bool)
    return (under is None or isinstance(under, str)) and (compare_from is None or number)


def remember(
    directory: str | None,
    key: str,
    strategy: str,
    reason: str,
    initialised_under: str | None = None,
    compare_from_steps: float | None = None,
) -> None:
    """Stores a decision atomically (a half-written file is never read); a directory that
    cannot be written only costs the next run a plan. ``initialised_under``: the candidate whose
    initialisation built the state the pick started from (the next run builds it the same way);
    ``compare_from_steps``: candidates were left uncompiled, and runs of that many steps or more
    compare them (:mod:`trainkit.planning.budget`)."""
    if directory is None:
        return
    path = path_for(directory, key)
    try:
        decision = {"strategy": strategy, "reason": reason, "initialised_under": initialised_under}
        atomic.write_text(path, json.dumps({**decision, "compare_from_steps": compare_from_steps}))
    except OSError as error:
        logger.warning("strategy='auto' could not remember its pick in %s (%s); the next run plans again", path, error)
