"""``Delegated``: an attribute that a facade reads from one of its members (and, given a
``setter``, writes through one of their methods).

>>> class Inner:
...     value = 3
>>> class Facade:
...     value = Delegated[int]("inner.value", "The inner value.")
...     def __init__(self):
...         self.inner = Inner()
>>> Facade().value, Facade.value.__doc__
(3, 'The inner value.')
>>> class Settable:
...     def __init__(self):
...         self.inner = Inner()
...     value = Delegated[int]("inner.value", "Settable.", setter="inner.set")
>>> Inner.set = lambda self, v: setattr(self, "value", v)
>>> facade = Settable(); facade.value = 5; facade.value
5
"""

from __future__ import annotations

import operator
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Delegated(Generic[T]):
    """The attribute at the dotted ``path`` of the instance (``"session.state"``), read on every
    access; written only through the method at the dotted ``setter`` path, when one is given
    (``"state_access.set_learning_rate"``); ``doc`` is what ``help()`` shows."""

    def __init__(self, path: str, doc: str = "", *, setter: str | None = None):
        self.path, self.__doc__ = path, doc
        self._read = operator.attrgetter(path)
        self._setter = None if setter is None else operator.attrgetter(setter)

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Delegated[T]: ...

    @overload
    def __get__(self, instance: Any, owner: type | None = None) -> T: ...

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else self._read(instance)

    def __set__(self, instance: Any, value: Any) -> None:
        if self._setter is not None:
            self._setter(instance)(value)
            return
        raise AttributeError(f"{self.path.rsplit('.', 1)[-1]} is read-only here: it is {self.path}'s.")
