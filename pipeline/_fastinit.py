"""``fast_init``: a cheaper ``__init__`` for the frozen records a load makes per tensor.

A frozen dataclass's generated ``__init__`` sets each field with ``object.__setattr__``,
which finds the field's slot by name every time. The records made once per tensor (its
header entry, index entry, placement and slot) are built hundreds to thousands of times
in every load, on the path between the call to ``load`` and the first byte read. The
``__init__`` that ``fast_init`` writes sets each slot through its descriptor instead:
the same fields, order, keywords and immutability, about half the cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["fast_init"]

_T = TypeVar("_T")


def fast_init(cls: type[_T]) -> type[_T]:
    """Decorate a ``@dataclass(frozen=True, slots=True)`` (applied first, below this one)
    whose fields have no defaults and which has no ``__post_init__``. Raises
    ``TypeError`` for any other class, rather than building it wrong."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init needs a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: fast_init does not run __post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if any(
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        for f in fields
    ):
        raise TypeError(f"{cls.__name__}: fast_init takes fields without defaults only")
    names = [f.name for f in fields]
    setters: dict[str, Any] = {f"_set_{name}": getattr(cls, name).__set__ for name in names}
    # Generated as dataclasses generates its own: one plain function, no loop per call.
    source = f"def __init__(self, {', '.join(names)}):\n" + "".join(
        f"    _set_{name}(self, {name})\n" for name in names
    )
    namespace: dict[str, Any] = {}
    exec(source, setters, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
