"""Name lookup for classes a config names: every concrete subclass, user ones included."""

from __future__ import annotations

import inspect


def concrete_subclasses(base: type) -> dict[str, type]:
    """Lowercase class name → class, for every non-abstract, non-private subclass of ``base``
    (the first found wins a name)."""
    found: dict[str, type] = {}
    pending = list(base.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        if not inspect.isabstract(cls) and not cls.__name__.startswith("_"):
            found.setdefault(cls.__name__.lower(), cls)
    return found
