"""Static sparsity: a mask chosen at apply time (random, top-k, ...) that never changes."""

from __future__ import annotations

from ..base import SparsityAlgorithm


class Static(SparsityAlgorithm):
    """Fixed mask with an exact count; created by ``apply(model)``, no initialize step needed.

    Takes the arguments of [`SparsityAlgorithm`][sparsity.SparsityAlgorithm]; the mask comes
    from ``init_method`` and never changes. A checkpoint whose mask has another level is moved
    to the configured one as it loads, with a warning.
    """

    def update(self) -> None:
        """Nothing changes after initialisation; weights are re-masked by the step hooks."""
