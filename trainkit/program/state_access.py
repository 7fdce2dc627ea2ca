"""``StateAccess``: the live state's reads and edits, for the trainer, ``tk.weights`` and the
callbacks: the one way to write it (:meth:`StateAccess.update_state`, placed in the shardings
of what it replaces), the learning rate, the variables got, set, loaded and saved, LoRA's
merged variables, the parameter count, what a checkpoint's manifest records of them, and a
trial's edits put back (:meth:`StateAccess.kept`). The state itself is the session's.

>>> import numpy as np, optax, flax.linen as nn, trainkit as tk
>>> trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer=optax.sgd(0.1), strategy="single")
>>> _ = trainer.init((np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)))
>>> access = trainer.state_access
>>> access.count_params(), sorted(access.weight_targets())
(8, ['bias', 'kernel'])
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainkit import data as data_lib
from trainkit import distributed
from trainkit.core import lora as lora_lib
from trainkit.core import optimizers
from trainkit.core.state import TrainState, check_tree_matches
from trainkit.core.tree import JSON, PyTree
from trainkit.core.variables import named_variables, replaced
from trainkit.program.decisions import Decided
from trainkit.program.program import Program
from trainkit.record.session import Session
from trainkit.weights import Target


class GroupRates(Mapping[str, float]):
    """``trainer.learning_rate`` under an optimizer per group: each group's rate by name, read and
    set (``trainer.learning_rate["generator"] = 1e-4``).

    >>> import numpy as np, optax, flax.linen as nn, trainkit as tk
    >>> rate = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> trainer = tk.Trainer(nn.Dense(2), loss="mse", optimizer={"kernel": rate, "bias": rate}, strategy="single")
    >>> _ = trainer.init((np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)))
    >>> trainer.learning_rate["bias"] = 0.5
    >>> {group: round(rate, 6) for group, rate in trainer.learning_rate.items()}
    {'kernel': 0.1, 'bias': 0.5}
    """

    def __init__(self, access: StateAccess):
        self.access = access

    def __getitem__(self, group: str) -> float:
        rates = self.access.learning_rates()
        if group not in rates:
            raise KeyError(f"There is no optimizer group {group!r}: the groups are {list(rates)}.")
        return rates[group]

    def __setitem__(self, group: str, value: float) -> None:
        self.access.set_learning_rate(value, group)

    def __iter__(self) -> Iterator[str]:
        return iter(name for name in self.access.learning_rates() if name is not None)

    def __len__(self) -> int:
        return len(self.access.learning_rates())


class StateAccess:
    """Reads and edits of ``session``'s live state for ``program``'s model, placed by the
    strategy ``decided`` holds (chosen by the time a state exists), for the inputs it records."""

    def __init__(self, program: Program, session: Session, decided: Decided):
        self.program, self.session, self.decided = program, session, decided
        self.weights_source = ""  # where the last tk.weights.load read the variables from
        self.loaded_path: str | None = None  # the file or folder it read (save_pretrained never writes there)
        self._scheduled_rate: bool | None = None  # whether a schedule sets the injected learning rate

    def require_state(self) -> TrainState:
        return self.session.require_state()

    def update_state(self, **fields: PyTree) -> TrainState:
        """The one way to write the live state: fields (host or device values) placed in the
        shardings of those they replace; unchanged arrays stay as they are. A device array given
        that is not the live state's own is copied first: the next step donates the state's
        buffers, which would delete the caller's array (``b.update_state(params=a.state.params)``
        then training ``a`` or ``b``: "Array has been deleted")."""
        live = {id(leaf) for leaf in jax.tree.leaves(self.require_state())}

        def owned(leaf: object) -> object:
            return jnp.array(leaf, copy=True) if isinstance(leaf, jax.Array) and id(leaf) not in live else leaf

        return self.write_state(**{name: jax.tree.map(owned, value) for name, value in fields.items()})

    def write_state(self, **fields: PyTree) -> TrainState:
        """:meth:`update_state` of values trainkit made and holds nowhere else (nothing copied)."""
        state = self.require_state()
        placed: TrainState = self.decided.require_strategy().put_like(state.replace(**fields), state)
        self.session.replace_state(placed, moves_position=False)
        return placed

    # ------------------------------------------------------------------ the learning rate
    @property
    def learning_rate(self) -> float | GroupRates:
        """The optimizer's learning rate; under an optimizer per group, each group's (by name, settable)."""
        if self.program.groups is not None:
            return GroupRates(self)
        return self.learning_rates()[None]

    def learning_rates(self) -> dict[str | None, float]:
        """Each group's learning rate by name, or ``{None: rate}`` for one optimizer."""
        if self.program.groups is None:
            return {None: float(distributed.fetch(optimizers.require_learning_rate(self.require_state().opt_state)))}
        opt_state, groups = self.require_state().opt_state, self.program.groups
        rates = {name: optimizers.require_learning_rate(groups.inner_state(opt_state, name)) for name in groups.names}
        fetched = distributed.fetch(rates)
        return {name: float(fetched[name]) for name in groups.names}

    def set_learning_rate(self, value: float, group: str | None = None) -> None:
        """The optimizer's learning rate (``optax.inject_hyperparams``) set in the live state: ``group``'s
        alone, or (``None``) every group's."""
        self.require_settable_learning_rate()
        opt_state, groups = self.require_state().opt_state, self.program.groups
        if group is None:
            self.write_state(opt_state=optimizers.set_learning_rate(opt_state, value))
            return
        if groups is None:
            raise ValueError(f"The trainer has one optimizer, not groups: set trainer.learning_rate, not [{group!r}].")
        inner = optimizers.set_learning_rate(groups.inner_state(opt_state, group), value)
        self.write_state(opt_state=groups.with_inner_state(opt_state, group, inner))

    def require_settable_learning_rate(self) -> None:
        """Refuses, before anything changes, a learning rate that setting would not change: one
        the optimizer does not expose, or a schedule ``optax.inject_hyperparams`` recomputes at
        every update (traced once: the optimizer does not change)."""
        state = self.require_state()
        if self._scheduled_rate is None:
            self._scheduled_rate = optimizers.rate_is_scheduled(self.program.optimizer, state.opt_state, state.params)
        if self._scheduled_rate:
            raise ValueError(
                "The learning rate is a schedule given to optax.inject_hyperparams (learning_rate=<a schedule>): the "
                "optimizer recomputes it from its step count at every update, so setting it (trainer.learning_rate, "
                "LearningRateScheduler, ReduceLROnPlateau, find_learning_rate) would change nothing. To set it, pass "
                "a number, e.g. optax.inject_hyperparams(optax.sgd)(learning_rate=1e-3); or keep the schedule and do "
                "not set the rate."
            )

    # ------------------------------------------------------------------ the variables
    @property
    def host_params(self) -> PyTree:
        """Host NumPy copies of the parameters."""
        return jax.tree.map(np.asarray, distributed.fetch(self.require_state().params))

    def weights(self) -> PyTree:
        """Host copies of all variables: ``{"params": ..., **model_state}`` (Keras's ``get_weights``)."""
        state = self.require_state()
        host = distributed.fetch({"params": state.params, "model_state": state.model_state})
        return {"params": host["params"], **host["model_state"]}

    def set_weights(self, variables: PyTree) -> None:
        """Variables from :meth:`weights` (``{"params": ..., **model_state}``), or the parameters
        alone (``trainer.params``: the model state kept), put into the live state (same shapes)."""
        state = self.require_state()
        if isinstance(variables, dict) and str(jax.tree.structure(variables)) == str(jax.tree.structure(state.params)):
            check_tree_matches("set_weights", state.params, variables)
            self.update_state(params=variables)
            return
        if not isinstance(variables, dict) or "params" not in variables:
            raise ValueError(
                f"set_weights takes what get_weights gives ({{'params': ..., **model_state}}) or the parameters alone "
                f"(trainer.params, a tree of {sorted(state.params)}); received "
                f"{type(variables).__name__ if not isinstance(variables, dict) else sorted(map(str, variables))}."
            )
        variables = dict(variables)
        params = variables.pop("params")
        check_tree_matches("set_weights", (state.params, state.model_state), (params, variables))
        self.update_state(params=params, model_state=variables)

    def weight_targets(self) -> dict[str, Target]:
        """The variables published weights load into, by name (``tk.weights.load``), each with its
        live shape, dtype and sharding; under LoRA the base model's (a quantised kernel as the
        float array it stands for; no adapters)."""
        state = self.require_state()
        named = named_variables(state.params, state.model_state, is_leaf=lora_lib.is_quantized)
        return {
            name: Target(*lora_lib.float_view(leaf)) for name, leaf in named.items() if not lora_lib.is_adapter(name)
        }

    def put_weights(self, arrays: dict[str, Any], source: str = "", path: str | None = None) -> None:
        """Loaded variables (placed in the live shardings) written into the live state (under
        QLoRA the base kernels quantised as the live ones are); ``source`` names where they came
        from (an adapter checkpoint records it), ``path`` the file or folder read (``save_pretrained``
        never writes there)."""
        state = self.require_state()
        self.weights_source, self.loaded_path = source, path
        params, model_state = replaced(state.params, state.model_state, arrays)
        if self.program.lora is not None:  # the base's kernels may be quantised nodes: replaced whole
            params = lora_lib.with_base(state.params, arrays)
        self.write_state(params=params, model_state=model_state)

    def named_weights(self) -> dict[str, np.ndarray]:
        """Host copies of the variables by name (``trainer.save_weights``); under LoRA those of
        the merged model."""
        params, model_state = self._host_merged()
        return {name: np.asarray(leaf) for name, leaf in named_variables(params, model_state).items()}

    def named_adapters(self) -> tuple[lora_lib.LoRA, dict[str, np.ndarray]]:
        """LoRA's settings and host copies of its adapters by name (``save_pretrained(adapter=True)``)."""
        lora = self.program.lora
        if lora is None:
            raise ValueError(
                "save_pretrained(adapter=True): this trainer has no LoRA adapters (Trainer(lora=tk.LoRA(...)) trains "
                "them); adapter=False writes the whole model."
            )
        adapters = distributed.fetch(lora_lib.adapters_only(self.require_state().params))  # not the base
        return lora, {name: np.asarray(leaf) for name, leaf in named_variables(adapters, {}).items()}

    def _host_merged(self) -> tuple[PyTree, PyTree]:
        """Host copies of the parameters (under LoRA the merged model's) and the model state."""
        state = self.require_state()
        host = distributed.fetch({"params": state.params, "model_state": state.model_state})
        return self.program.merged_params(host["params"]), host["model_state"]

    def merged(self) -> tuple[dict[str, PyTree], PyTree]:
        """Host variables of the model without LoRA's adapters, folded into its kernels
        (``trainer.merge_lora``): ``{"params": ..., **model_state}``, and a one-row input of
        zeros to initialise it with."""
        if self.program.lora is None:
            raise ValueError("merge_lora(): this trainer has no LoRA adapters (Trainer(lora=tk.LoRA(...))).")
        params, model_state = self._host_merged()
        variables = {"params": jax.tree.map(np.asarray, params), **model_state}
        sample = jax.tree.map(
            lambda s: np.zeros(s.shape, s.dtype), data_lib.abstract_inputs(self.decided.input_spec, 1)
        )
        return variables, sample

    def count_params(self) -> int:
        """The scalars in all variables (parameters and model state), as Keras counts."""
        state = self.require_state()
        return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves((state.params, state.model_state))))

    def settings(self) -> dict[str, JSON]:
        """The settings a checkpoint's manifest records besides the position."""
        program = self.program
        settings: dict[str, JSON] = {
            "precision": str(program.precision.compute_dtype),
            "seed": program.seed,
            "grad_accum_steps": program.grad_accum_steps,
        }
        if program.lora is not None:  # an adapter checkpoint names the base it adapts
            digest = lora_lib.base_digest(distributed.fetch(self.require_state().params))
            lora = {**dataclasses.asdict(program.lora), "base_sha256": digest, "base_source": self.weights_source}
            settings["lora"] = lora
        return settings

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Everything a trial ``fit`` changes put back exactly on exit, raised or not: the
        session (one snapshot; its state a host copy, placed again in its shardings) and the
        decisions (one value)."""
        session, decisions, strategy = self.session, self.decided.value, self.decided.require_strategy()
        snapshot = session.snapshot()
        host = distributed.fetch(session.require_state())
        try:
            yield
        finally:
            session.restore(dataclasses.replace(snapshot, state=strategy.put_state(host)))
            self.decided.restore(decisions)
