"""A trainer's ``train_step`` / ``test_step`` override (Keras's habit) as a
:class:`~trainkit.core.step_value.Step` value: a thin adapter that calls the override with
``self`` a *frozen view* of the trainer.

The view is an instance of the trainer's own class (``super().train_step(...)`` works) whose
reads go to the trainer and whose writes fail:

- an attribute the step sets while traced raises the dataclass's ``FrozenInstanceError``, which
  :func:`~trainkit.core.step_value.frozen_while_traced` turns into trainkit's named error (the
  trainer itself never holds a tracer);
- each plain value it reads (``self.beta``: a number of any kind, a string, a tuple of them) is
  recorded as it was read: :meth:`OverrideStep.watched` reads the same names now, so a changed
  one retraces between fits and stops a fit it changed during;
- the helpers that live on the state (``self.mean``, ``self.apply_gradients``, ...) are refused
  naming ``state.<helper>``; ``self.apply`` only in the override's own body (a ``compute_loss``
  it calls runs the model by ``self.apply``, as the built-in step's does).

>>> class Owner:
...     beta = 0.5
...     def train_step(self, state, batch, rng):
...         return state, {"beta": self.beta}
>>> step = OverrideStep(Owner(), trains_own=True, tests_own=False)
>>> step.train(None, None, None)
(None, {'beta': 0.5})
>>> step.traced_values(), step.trains, step.tests
({'beta': 0.5}, True, False)
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax

from trainkit.core.state import Batch, TrainState
from trainkit.core.step_state import StepState
from trainkit.core.step_value import Step, as_read, checked_step, is_plain

#: the helpers that moved from the trainer (``self.mean``) to the state the step threads (``state.mean``)
MOVED_HELPERS = ("apply", "apply_gradients", "mean", "normal", "all_rows")


@dataclasses.dataclass(frozen=True)
class _ViewFacts:
    """What a view reads through: the trainer, the reads of this step's traces, and the step whose
    own body it is (``None``: a method the step called)."""

    owner: object
    reads: dict[str, object]
    body: str | None


def moved_helper(owner: str, where: str, helper: str) -> TypeError:
    """The refusal of ``self.<helper>`` in a step: it lives on the state the step threads."""
    return TypeError(
        f"{owner}.{where} calls self.{helper}(...): the step's helpers live on the state it threads, which knows "
        f"the strategy tracing the step. Write state.{helper}(...) instead of self.{helper}(...)"
        + (" (and drop the state argument: state = state.apply_gradients(grads, group=...))" if helper ==
           "apply_gradients" else "")
        + f"; the helpers: {', '.join(f'state.{h}' for h in MOVED_HELPERS)} (docs/custom_training.md)."
    )  # fmt: skip


_MISSING = object()


def _attribute(owner: object, name: str) -> object:
    """``owner.<name>``, the trainer's attribute a step reads through its view (``_MISSING``: it has none)."""
    return getattr(owner, name, _MISSING)


def _read(view: object, name: str) -> object:
    if name.startswith("__") and name.endswith("__") or name == "_trainkit_view":
        return object.__getattribute__(view, name)
    facts: _ViewFacts = object.__getattribute__(view, "_trainkit_view")
    cls = type(facts.owner)
    if name in MOVED_HELPERS and (facts.body is not None or name != "apply"):
        raise moved_helper(cls.__name__, facts.body or "train_step", name)
    value = _attribute(facts.owner, name)
    if value is _MISSING:
        raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}", name=name, obj=facts.owner)
    if isinstance(value, types.MethodType) and value.__self__ is facts.owner:
        if value.__func__.__module__.startswith("trainkit."):
            return value  # trainkit's own (compute_loss, apply): on the trainer itself
        return types.MethodType(value.__func__, view_of(facts.owner, facts.reads, None))
    if is_plain(value):
        facts.reads[name] = as_read(value)
    return value


def _refuse_write(view: object, name: str, value: object = None) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _bind(self: object, facts: _ViewFacts) -> None:
    """The view's one field, set once when it is made (then frozen)."""
    object.__setattr__(self, "_trainkit_view", facts)


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(cls: type) -> type:
    """``cls`` with reads through the trainer and writes refused (made once per class)."""
    if cls not in _VIEW_CLASSES:
        namespace = {"__getattribute__": _read, "__setattr__": _refuse_write, "__delattr__": _refuse_write}
        names = {"__qualname__": cls.__qualname__, "__module__": cls.__module__}
        _VIEW_CLASSES[cls] = type(cls.__name__, (cls,), {**namespace, **names})
    return _VIEW_CLASSES[cls]


def view_of(owner: object, reads: dict[str, object], body: str | None) -> object:
    """A frozen view of ``owner`` (the trainer) recording its plain reads in ``reads``; ``body``:
    the step whose own code reads it (``self.apply`` refused there)."""
    view: object = object.__new__(_view_class(type(owner)))
    _bind(view, _ViewFacts(owner, reads, body))
    return view


@dataclasses.dataclass(frozen=True)
class OverrideStep(Step):
    """The trainer's ``train_step`` (``trains_own``) and ``test_step`` (``tests_own``) overrides
    as a step value; ``reads``: the plain values its traces read from ``self``, as read."""

    owner: Overridable
    trains_own: bool
    tests_own: bool
    reads: dict[str, object] = dataclasses.field(default_factory=dict, compare=False)

    def train(self, state: StepState, batch: Batch, rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        step: Callable[..., tuple[TrainState, dict[str, jax.Array]]] = type(self.owner).train_step
        return step(view_of(self.owner, self.reads, "train_step"), state, batch, rng)

    def test(self, state: StepState, batch: Batch, rng: jax.Array) -> dict[str, jax.Array]:
        step: Callable[..., dict[str, jax.Array]] = type(self.owner).test_step
        return step(view_of(self.owner, self.reads, "test_step"), state, batch, rng)

    @property
    def trains(self) -> bool:
        return self.trains_own

    @property
    def tests(self) -> bool:
        return self.tests_own

    def traced_values(self) -> dict[str, object]:
        return dict(self.reads)

    def watched(self) -> dict[str, object]:
        """The values its traces read from the trainer, as the trainer holds them now."""
        now = {name: _attribute(self.owner, name) for name in self.reads}
        return {name: as_read(value) for name, value in now.items() if value is not _MISSING}


def replacing(current: Step | None, new: object) -> Step:
    """``new`` as the value that replaces ``current`` (``trainer.step = ...``): a checked step of
    the same class as a step given as ``Trainer(step=...)``; refused for the built-in step, an
    override's adapter, or a step of another class."""
    if current is None or isinstance(current, OverrideStep):
        runs = "the built-in step" if current is None else "its train_step / test_step overrides"
        also = (
            "" if current is None else ": change the values they read from self instead (traced again at the next fit)"
        )
        raise TypeError(
            f"trainer.step = ... replaces a step given as Trainer(step=...); this trainer runs {runs}{also}."
        )
    step = checked_step(new)
    if type(step) is not type(current):
        raise TypeError(
            f"trainer.step = {type(step).__name__}(...) replaces a {type(current).__name__}: a new value of the same "
            "step (dataclasses.replace(trainer.step, ...)); another step is another Trainer."
        )
    return step


class Overrides(NamedTuple):
    """Which of a trainer's override points its class overrides (:func:`overrides`)."""

    compute_loss: bool
    train_step: bool
    #: a ``test_step`` of its own, or none to evaluate by (a ``train_step`` of its own, no loss)
    test_step: bool
    #: a step value was given (``Trainer(step=...)``)
    step: bool = False

    @property
    def loss(self) -> bool:
        """The loss is the user's (``compute_loss``, ``train_step`` or a step value): ``loss=`` may be left out."""
        return self.compute_loss or self.train_step or self.step


class Overridable(Protocol):
    """A trainer class as :func:`overrides` reads it: its override points."""

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any: ...

    def train_step(self, *args: Any, **kwargs: Any) -> Any: ...

    def test_step(self, *args: Any, **kwargs: Any) -> Any: ...


def overrides(cls: type[Overridable], base: type[Overridable], *, has_loss: bool, step: object = None) -> Overrides:
    """What ``cls`` (a ``Trainer`` subclass) overrides of ``base`` (``Trainer``): raises for a
    ``train_step`` / ``test_step`` of the wrong signature (:func:`overridden`); ``has_loss``:
    ``loss=`` was given (else a ``train_step`` of its own evaluates by its ``test_step``);
    ``step``: the ``step=`` given (a value replacing the built-in step)."""
    train = overridden(cls.train_step, base.train_step, cls.__name__)
    test = overridden(cls.test_step, base.test_step, cls.__name__)
    own_loss = cls.compute_loss is not base.compute_loss
    return Overrides(own_loss, train, test or (train and not has_loss and not own_loss), step is not None)


def step_of(owner: Overridable, own: Overrides, step: object) -> Step | None:
    """The step value a trainer runs: ``step`` (``Trainer(step=...)``, checked), the adapter of
    its ``train_step`` / ``test_step`` overrides, or ``None`` (the built-in step)."""
    if step is not None:
        if own.train_step or own.test_step:
            raise TypeError(
                f"{type(owner).__name__} overrides train_step or test_step and was given step= too: one step runs. "
                "Keep the override, or move it into the tk.Step (its train / test methods) and drop the override."
            )
        return checked_step(step)
    if own.train_step or own.test_step:
        return OverrideStep(owner, trains_own=own.train_step, tests_own=own.test_step)
    return None


def overridden(method: Callable[..., object], default: Callable[..., object], owner: str) -> bool:
    """Whether ``method`` (a class's ``train_step`` / ``test_step``) overrides the ``default`` one;
    raises for an override that does not take ``(state, batch, rng)`` (Keras's ``train_step(self,
    state, data)`` or ``train_step(self, data)``, which trainkit would otherwise never call)."""
    if method is default:
        return False
    name = default.__name__
    try:
        parameters = list(inspect.signature(method).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.kind == p.VAR_POSITIONAL for p in parameters) and len(positional) != 3:
        returns = "(state, logs)" if name == "train_step" else "logs"
        raise TypeError(
            f"{owner}.{name} takes ({', '.join(p.name for p in parameters)}), but trainkit calls "
            f"{name}(self, state, batch, rng) -> {returns}: state a StepState (state.params, state.opt_state, "
            "state.model_state), batch a dict ('x', 'y', 'mask', maybe 'sample_weight'), rng this step's key. "
            "Keras's train_step(self, state, data) / train_step(self, data) map onto it as docs/custom_training.md "
            "shows (gradients through state.apply_gradients(grads), losses through state.mean(values, batch))."
        )
    return True


def not_callable(name: str) -> NotImplementedError:
    """What calling the default ``train_step`` / ``test_step`` raises: ``super().train_step(...)``,
    or an evaluation of a trainer whose own ``train_step`` has no loss to evaluate by."""
    if name == "test_step":
        return NotImplementedError(
            "evaluate and validation run test_step(self, state, batch, rng) -> logs, and this trainer has a "
            "train_step of its own but neither loss= nor compute_loss for the built-in evaluation: override "
            "test_step (e.g. return {'d_loss': state.mean(per_row, batch)}), or pass loss=... ."
        )
    return NotImplementedError(
        "Trainer.train_step has no body to call: without an override trainkit runs its built-in step (compute_loss, "
        "the optimizer, the metrics) directly. In an override, compute the loss with self.compute_loss(...) or "
        "state.apply(...) and state.mean(...), and update with state = state.apply_gradients(grads)."
    )
