"""``cstorch.utils``: ``data`` (DataLoader, DataExecutor)."""

from . import data

__all__ = ["data"]
