"""``Delegated``: a read-only attribute that a facade reads from one of its members.

>>> class Inner:
...     value = 3
>>> class Facade:
...     value = Delegated[int]("inner.value", "The inner value.")
...     def __init__(self):
...         self.inner = Inner()
>>> Facade().value, Facade.value.__doc__
(3, 'The inner value.')
"""

from __future__ import annotations

import operator
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Delegated(Generic[T]):
    """The attribute at the dotted ``path`` of the instance (``"session.state"``), read on every
    access and never written through the facade; ``doc`` is what ``help()`` shows."""

    def __init__(self, path: str, doc: str = ""):
        self.path, self.__doc__ = path, doc
        self._read = operator.attrgetter(path)

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Delegated[T]: ...

    @overload
    def __get__(self, instance: Any, owner: type | None = None) -> T: ...

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else self._read(instance)

    def __set__(self, instance: Any, value: Any) -> None:
        raise AttributeError(f"{self.path.rsplit('.', 1)[-1]} is read-only here: it is {self.path}'s.")
