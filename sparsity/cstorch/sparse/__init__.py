"""``cstorch.sparse``: cstorch 2.x's sparsity API and semantics on plain PyTorch.

Its submodules are importable as in cstorch: ``from sparsity.cstorch.sparse import RigL``,
``sparsity.cstorch.sparse.utils.make_mask_topk_sparsity``, ``...sparse.init.random``.
This is cstorch's behaviour (global-RNG masks, float32 truncating counts, hooks every step);
``sparsity`` itself is csx-sparse's own API (docs/cstorch.md says how they differ).
"""

from . import init, utils
from .base import SparseParameter, SparsityAlgorithm
from .configure import configure, default_sparse_param_filter, flatten_sparsity_params, map_sparsity_algorithm
from .dynamic import DynamicSparsityAlgorithm
from .gmp import GMP
from .group import Group
from .legacy import LegacySparsityOptimizer, configure_sparsity_optimizer, configure_sparsity_wrapper
from .rigl import RigL
from .set import SET
from .static import Static
from .utils import (
    HyperParameterSchedule,
    InputGroupScoreShaper,
    OutputGroupScoreShaper,
    ScoreFlattener,
    ScoreShaper,
    ScoreTiebreaker,
    UpdateSchedule,
)

__all__ = [
    "SparsityAlgorithm", "DynamicSparsityAlgorithm", "SparseParameter", "Static", "GMP", "SET", "RigL",
    "Group", "configure", "map_sparsity_algorithm", "default_sparse_param_filter", "flatten_sparsity_params",
    "configure_sparsity_optimizer", "configure_sparsity_wrapper", "LegacySparsityOptimizer",
    "HyperParameterSchedule", "UpdateSchedule", "ScoreShaper", "ScoreFlattener", "OutputGroupScoreShaper",
    "InputGroupScoreShaper", "ScoreTiebreaker", "init", "utils",
]
