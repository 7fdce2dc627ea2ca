"""A checkpoint's manifest: the JSON it records besides the arrays (versions, strategy and mesh,
position, data state, settings, every leaf's shape and dtype), its position checked on read, and
what a restore into another layout means for exactness.

>>> checked_position({"position": {"epoch": 0, "batch": 3, "global_step": 3}}, "ck/3")["batch"]
3
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import flax.serialization
import jax

from trainkit import distributed
from trainkit.checkpoint.errors import CheckpointError
from trainkit.core import tree
from trainkit.core.tree import JSON, PyTree
from trainkit.record.session import Position, Session
from trainkit.version import __version__

logger = logging.getLogger("trainkit")

#: A checkpoint's manifest as ``json`` reads it back: each entry of the JSON type its writer gave it
#: (``position`` a dict of integers, ``tree`` a dict of :func:`~trainkit.core.tree.signature` results, ...).
#: a checkpoint's manifest as JSON read back (its entries read by key, each checked where it is used)
Manifest = dict[str, Any]
#: A state as a checkpoint stores it: ``{"params": ..., "opt_state": ..., ...}``.
StateDict = dict[str, PyTree]


class Layout(Protocol):
    """What a manifest records of the strategy that wrote it (a :class:`trainkit.Strategy`;
    ``checkpoint/`` does not import ``strategies/``): its mesh, its devices and its description."""

    @property
    def mesh(self) -> jax.sharding.Mesh: ...

    @property
    def devices(self) -> list[jax.Device]: ...

    def describe(self) -> str: ...


def _require(layout: Layout | None) -> Layout:
    if layout is None:
        raise RuntimeError("The trainer has no strategy yet: call fit(...) or init(sample_batch) first.")
    return layout


def checked_position(manifest: Manifest, where: str) -> dict[str, int]:
    """The manifest's ``position``: ``epoch``, ``batch`` and ``global_step``, integers >= 0;
    else a :class:`CheckpointError` naming the field (a hand-edited or foreign manifest).

    >>> checked_position({"position": {"epoch": 1, "batch": 0, "global_step": 8}}, "ck/8")["global_step"]
    8
    """
    position = manifest.get("position")
    if not isinstance(position, dict):
        raise CheckpointError(
            f"The manifest of {where} has no position (received {position!r}): it was edited or written by "
            "something else than trainkit. Resume from an untouched checkpoint."
        )
    for field in ("epoch", "batch", "global_step"):
        value = position.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(
                f"The manifest of {where} has position.{field} = {value!r}; it must be an integer >= 0. The "
                "manifest was edited or written by something else than trainkit: resume from an untouched checkpoint."
            )
    return position


#: The layout of the state a checkpoint holds (its paths' spelling), raised when trainkit changes
#: it; a checkpoint without one was written before it was recorded (layout 1).
LAYOUT = 2


def older_layout(manifest: Manifest) -> str:
    """For a checkpoint whose state does not match: a sentence saying it was written by an older
    trainkit, whose state paths may be spelt otherwise (``""`` for one of this layout).

    >>> older_layout({"trainkit_version": "0.0.9"})[:47]
    'It was written by an older trainkit (0.0.9, che'
    """
    layout = manifest.get("layout", 1)
    if isinstance(layout, int) and layout >= LAYOUT:
        return ""
    return (
        f"It was written by an older trainkit ({manifest.get('trainkit_version', 'unknown')}, checkpoint layout "
        f"{layout}; this one writes layout {LAYOUT}), whose state's paths may be spelt otherwise for the same model "
        "and optimizer: restore it with that trainkit, or load its variables alone with "
        "tk.weights.load(path, into=trainer, prefix=...) where the names still match. "
    )


def build_manifest(
    state: PyTree, strategy: Layout, position: Position, data_state: JSON = None, **settings: JSON
) -> Manifest:
    """What a checkpoint records besides the arrays: versions, the strategy and mesh, the data
    ``position`` (``epoch``, ``batch``, ``step``) and ``data_state`` (every process's, gathered),
    ``settings`` (precision, seed, batch size...) and the shape and dtype of every leaf of the
    parameters, optimizer state and model state."""
    parts = flax.serialization.to_state_dict(state)
    if data_state is not None:
        settings["data_state"] = distributed.gather_json(data_state)
    return {
        "trainkit_version": __version__,
        "layout": LAYOUT,
        "jax_version": jax.__version__,
        "strategy": type(strategy).__name__,
        "strategy_description": strategy.describe(),
        "mesh": {name: int(size) for name, size in strategy.mesh.shape.items()},
        "device_count": len(strategy.devices),
        "process_count": jax.process_count(),
        **settings,
        "position": {"epoch": position.epoch, "batch": position.batch, "global_step": position.step},
        "tree": {part: tree.signature(parts[part]) for part in ("params", "opt_state", "model_state")},
    }


def explain_restore(manifest: Manifest, into: Layout | None, batch_size: int | None) -> None:
    """Logs what a restore into another strategy (``into``), device count or batch size means
    for the run's exactness (a batch index is converted by examples seen)."""
    strategy, devices = type(into).__name__, len(_require(into).devices)
    mesh = {name: int(size) for name, size in _require(into).mesh.shape.items()}
    same_mesh = manifest.get("mesh") in (None, mesh)  # Hybrid(data=2, context=4) and Hybrid(data=2, stage=4) differ
    if manifest.get("device_count") != devices or manifest.get("strategy") != strategy or not same_mesh:
        meshes = "" if same_mesh else f" (mesh {manifest.get('mesh')} -> {mesh})"
        logger.warning(
            "Restored step %s written by %s on %s devices into %s on %s devices%s: the state is "
            "exact; later steps reduce over another device layout, so they match the "
            "original run to float rounding, not bit for bit; and a model with dropout draws its masks "
            "per device, so under another layout its later steps take other masks (the same "
            "distribution, other numbers).",
            manifest["position"]["global_step"],
            manifest.get("strategy"),
            manifest.get("device_count"),
            strategy,
            devices,
            meshes,
        )
    if batch_size is not None and manifest.get("batch_size") not in (None, batch_size):
        batch = manifest["position"]["batch"] * manifest["batch_size"] // batch_size
        logger.warning(
            "The checkpoint was written with batch_size=%s, this run uses %s: the data "
            "position is converted by examples seen (batch %s -> %s), and the batches, and "
            "so the updates, differ from the original run from here on.",
            manifest["batch_size"],
            batch_size,
            manifest["position"]["batch"],
            batch,
        )


def manifest_of(session: Session, strategy: Layout | None, settings: dict[str, JSON]) -> Manifest:
    """The manifest of ``session``'s live state under ``strategy`` (a ``Strategy``): the trainer's
    ``settings``, the batch size and data state, and the goodput ledger so far when it runs (a
    resume carries it on: ``BackupAndRestore``)."""
    settings = {**settings, "batch_size": session.batch_size, "data_state": session.data_state}
    if session.ledger.active:
        settings["goodput"] = session.ledger.saved()
    return build_manifest(session.require_state(), _require(strategy), session.position, **settings)
