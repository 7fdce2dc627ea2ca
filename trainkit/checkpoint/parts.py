"""What a checkpoint holds of a state, one policy for saving and restoring: the whole state; only
the variables (``weights_only``: ``params`` and ``model_state``); under LoRA only the adapters of
the parameters (the base is the weights it was loaded from, checked by its SHA-256 on restore).
The one module of the checkpointer that knows LoRA.

>>> state = {"params": {"w": 1}, "opt_state": {"mu": 0}, "model_state": {}, "step": 3}
>>> policy = Parts.written_as({}, weights_only=True)
>>> sorted(policy.written(state, {"tree": {"params": "f32[]", "opt_state": "f32[]"}})[0])
['model_state', 'params']
>>> Parts.of({"contents": "weights"}).weights_only, Parts.of({"lora": {}}).adapters_only
(True, True)
"""

from __future__ import annotations

import dataclasses

import flax.serialization
import jax

from trainkit import distributed
from trainkit.checkpoint.errors import CheckpointError
from trainkit.checkpoint.manifest import Manifest, StateDict
from trainkit.core import lora as lora_lib
from trainkit.core import tree
from trainkit.core.tree import PyTree

#: The parts of a state that ``weights_only`` checkpoints hold.
WEIGHTS = ("params", "model_state")


@dataclasses.dataclass(frozen=True)
class Parts:
    """Which parts of a state a checkpoint holds: only the variables (``weights_only``), and of
    the parameters only LoRA's adapters (``adapters_only``)."""

    weights_only: bool = False
    adapters_only: bool = False

    @classmethod
    def written_as(cls, manifest: Manifest, weights_only: bool) -> Parts:
        """The parts a save writes: a LoRA trainer's (its manifest records ``lora``) adapters only."""
        return cls(weights_only=weights_only, adapters_only="lora" in manifest)

    @classmethod
    def of(cls, manifest: Manifest) -> Parts:
        """The parts a written checkpoint holds, from its manifest."""
        return cls(weights_only=manifest.get("contents") == "weights", adapters_only="lora" in manifest)

    def written(self, state_dict: StateDict, manifest: Manifest) -> tuple[StateDict, Manifest]:
        """The state dict and manifest a save writes of ``state_dict`` (the manifest's tree and
        ``contents`` matching what is written)."""
        if self.adapters_only:  # the base is the weights it was loaded from: only the adapters are written
            state_dict, manifest = _adapters_part(state_dict, manifest)
        if self.weights_only:
            state_dict = {part: state_dict[part] for part in WEIGHTS}
            written_tree = {part: value for part, value in manifest.get("tree", {}).items() if part in WEIGHTS}
            manifest = dict(manifest, contents="weights", tree=written_tree)
        return state_dict, manifest

    def check(self, manifest: Manifest, target: PyTree, where: str) -> None:
        """Refuses a restore these parts cannot go into (adapters into another base: :func:`_check_base`)."""
        if self.adapters_only:
            _check_base(manifest, target.params, where)

    def stored(self, parts: StateDict) -> StateDict:
        """A target's state dict as the checkpoint stores its parts (adapters for parameters)."""
        return {**parts, "params": lora_lib.adapters_only(parts["params"])} if self.adapters_only else parts

    def read(self, parts: StateDict) -> StateDict:
        """The parts of a target's (stored) state dict the restore reads."""
        return {part: parts[part] for part in WEIGHTS} if self.weights_only else parts

    def restored(self, restored: StateDict, target: StateDict) -> StateDict:
        """The restored parts as a whole state dict of ``target``'s: adapters into its live base,
        the parts not held (weights only) kept as they are."""
        if self.adapters_only:
            restored = {**restored, "params": lora_lib.with_adapters(target["params"], restored["params"])}
        return {**target, **restored} if self.weights_only else restored


def _adapters_part(state_dict: StateDict, manifest: Manifest) -> tuple[StateDict, Manifest]:
    """A LoRA trainer's state as its checkpoint holds it: the adapters of the parameters (and
    everything else: the optimizer state is the adapters' alone), the manifest's tree to match."""
    params = lora_lib.adapters_only(state_dict["params"])
    written = dict(manifest.get("tree", {}), params=tree.signature(params))
    return {**state_dict, "params": params}, {**manifest, "tree": written}


def _check_base(manifest: Manifest, params: PyTree, where: str) -> None:
    """Refuses adapters restored into a trainer without adapters, into a base stored another way
    (int8, nf4, float), or trained on other base weights than the live ones (their SHA-256)."""
    saved = manifest["lora"]
    settings = ", ".join(f"{key}={saved.get(key)!r}" for key in ("rank", "alpha", "targets", "quantize_base"))
    if not lora_lib.adapters_only(flax.serialization.to_state_dict(params)):
        raise CheckpointError(
            f"The checkpoint at {where} holds LoRA adapters (tk.LoRA({settings})), but this trainer has none: create "
            f"it with Trainer(..., lora=tk.LoRA({settings})), load the base weights into it, then restore."
        )
    stored, live_stored = saved.get("quantize_base"), lora_lib.quantization(params)
    if stored != live_stored:

        def name(kind: str | None) -> str:
            return f"quantised as {kind}" if kind else "in floats (no quantize_base)"

        raise CheckpointError(
            f"The adapters at {where} were trained on a base stored {name(stored)}; this trainer's base is stored "
            f"{name(live_stored)}: create it with tk.LoRA({settings}), then restore."
        )
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params)):
        return  # an abstract target: no values to compare
    recorded, live = saved.get("base_sha256"), lora_lib.base_digest(distributed.fetch(params))
    if recorded != live:
        source = saved.get("base_source") or "weights not recorded"
        raise CheckpointError(
            f"The adapters at {where} were trained on other base weights ({source}, SHA-256 {str(recorded)[:12]}...) "
            f"than this trainer holds (SHA-256 {live[:12]}...): load the same base weights first "
            "(tk.weights.load(source, into=trainer)), then restore."
        )
