"""One module per published algorithm; each overrides one method of its base."""

from .gmp import GMP
from .granet import GraNet
from .rigl import RigL
from .set import SET
from .static import Static

__all__ = ["Static", "GMP", "SET", "RigL", "GraNet"]
