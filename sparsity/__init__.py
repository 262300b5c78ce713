"""csx-sparse's sparsity library: the Cerebras ``cstorch.sparse`` API on plain PyTorch."""

from . import checkpoint, optim, plugins, schedules
from .algorithms import GMP, SET, GraNet, RigL, Static
from .base import (
    DEFAULT_PARAM_FILTER,
    DynamicSparsityAlgorithm,
    SparsityAlgorithm,
    algorithm_names,
    get_algorithm_class,
)
from .config import configure, configure_sparsity_wrapper
from .group import Group
from .schedules import BaseHyperParameter
from .wrapper import SparsityWrapperOptimizer
from .masks import (
    FirstTieBreaker,
    InputGroupScoreShaper,
    OutputGroupScoreShaper,
    RandomTieBreaker,
    ScoreFlattener,
    ScoreShaper,
    ScoreTieBreaker,
    drop_minimum,
    grow_maximum,
    keep_count,
    keep_top_active,
    topk_mask,
)

__all__ = [
    "SparsityAlgorithm",
    "DynamicSparsityAlgorithm",
    "Static",
    "GMP",
    "SET",
    "RigL",
    "GraNet",
    "Group",
    "configure",
    "configure_sparsity_wrapper",
    "SparsityWrapperOptimizer",
    "BaseHyperParameter",
    "checkpoint",
    "DEFAULT_PARAM_FILTER",
    "algorithm_names",
    "get_algorithm_class",
    "optim",
    "plugins",
    "schedules",
    "ScoreShaper",
    "ScoreTieBreaker",
    "ScoreFlattener",
    "OutputGroupScoreShaper",
    "InputGroupScoreShaper",
    "FirstTieBreaker",
    "RandomTieBreaker",
    "keep_count",
    "topk_mask",
    "keep_top_active",
    "drop_minimum",
    "grow_maximum",
]
