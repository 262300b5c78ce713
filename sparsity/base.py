"""The sparsity lifecycle: masks on a model, hooks on optimizers, a step counter, metrics, state.

``SparsityAlgorithm`` owns everything but the mask rule; ``DynamicSparsityAlgorithm`` adds the
update cadence and asks subclasses for one method, ``update_mask(p, mask, sparsity)``.

Per optimizer step t (any ``torch.optim`` optimizer, through its step hooks):

* backward: gradient hooks on the sparse parameters zero their gradients outside the masks
  when the backward pass ends, before ``backward()`` returns (exactly: NaN/inf at pruned
  positions become 0, as cstorch's ``where(mask, grad, 0)``), so ``clip_grad_norm_`` sees live
  weights only; before that, on the backward passes that precede an update step of a
  gradient-growing algorithm (RigL, GraNet), the dense gradient is added to a private copy
  (summed over micro-batches);
* pre-step: gradients written by other means than backward (assigned by hand) are masked the
  same way, and every optimizer state tensor of the parameter's shape is masked unless it is
  provably still masked;
* post-step: weights and state are masked again, the counter becomes t, and if t is an update
  step the masks change now and are used from forward t+1. An entry active before and after an
  update keeps its value and optimizer state; an entry grown from inactive starts at 0 (weight
  and state; SET/RigL/GraNet's ``grow_init`` can give it another initial weight).

Randomness comes from generators seeded by (seed, step, parameter name), never the global RNG, so
masks are identical on every run and every data-parallel replica, and no RNG state needs saving.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .distributions import get_distribution
from .filters import DEFAULT_PARAM_FILTER, ParamFilter, make_param_filter
from .init_methods import INIT_METHODS
from .keeping import MaskKeeper, SparseParam, fill_missing_mask
from .masks import RandomTieBreaker, TieBreaker, keep_count, move_to_level
from .stats import MaskStats
from .schedules import Constant, Schedule, UpdateSchedule, make_schedule, make_update_schedule

__all__ = [
    "SparsityAlgorithm",
    "DynamicSparsityAlgorithm",
    "SparseParam",
    "DEFAULT_PARAM_FILTER",
    "get_algorithm_class",
    "algorithm_names",
    "make_param_filter",
]


def _mixed_seed(*parts: int | str) -> int:
    """A 63-bit seed from ints and strings, stable across processes (unlike ``hash(str)``)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        word = zlib.crc32(part.encode()) if isinstance(part, str) else int(part)
        value = (value * 6364136223846793005 + word + 1442695040888963407) % (1 << 63)
    return value


class SparsityAlgorithm(MaskKeeper, ABC):
    """Base of every algorithm. Subclasses register by lowercase class name and override
    :meth:`update`, which runs after every optimizer step while ``autoupdate`` is on.

    ``model.apply(alg)`` (or ``alg.apply(model)``) creates the masks, as ``<param>_mask``
    buffers of each sparse parameter's module; ``alg.apply(optimizer)`` hooks the optimizer's
    steps, after which weights, gradients and optimizer state stay masked.

    Args:
        sparsity: The fraction of each selected parameter's entries that is zero, in [0, 1):
            a number, or a schedule of the step (a ``{"type": ...}`` dict, a list for
            ``cycling``, a callable, or a ``sparsity.schedules.Schedule``).
        param_filter: Which parameters are sparse: fnmatch globs on full parameter names (one
            or a list), or a callable ``(name, param) -> bool``. Default:
            [`DEFAULT_PARAM_FILTER`][sparsity.DEFAULT_PARAM_FILTER] (matrices, not embeddings,
            norms, ``lm_head`` or ``pe_helper``).
        init_method: The first mask: ``"random"``, ``"topk"`` (largest |w|), ``"from_zeros"``
            (the weight's zeros), ``"checkerboard"``, or a callable returning a bool mask.
        distribution: How the global level spreads over the layers: ``"uniform"``, ``"er"``
            or ``"erk"`` (Erdős–Rényi(-Kernel)).
        seed: Seeds every random choice, with the step and the parameter name, so masks are
            identical on every run and replica.
        tie_breaker: Orders equal scores (default: a random order seeded by seed, step and
            parameter name).

    Raises:
        ValueError: ``sparsity`` missing or outside [0, 1), an unknown ``init_method`` or
            ``distribution``, a ``seed`` that is not an int, or a ``tie_breaker`` that is not
            a [`ScoreTieBreaker`][sparsity.ScoreTieBreaker]; also, when a subclass is defined
            with the name of a built-in algorithm.
    """

    registry: ClassVar[dict[str, type[SparsityAlgorithm]]] = {}
    grows_by_gradient: ClassVar[bool] = False
    registered: ClassVar[bool] = True  # containers such as Group set False: not an algorithm name

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # cstorch's signature is update(self, optimizer=None); ours calls update() unless asked
        cls._update_takes_optimizer = "optimizer" in inspect.signature(cls.update).parameters
        if not cls.__dict__.get("registered", True):
            return
        name = cls.__name__.lower()
        built_in = SparsityAlgorithm.registry.get(name)
        if built_in is not None and _is_built_in(built_in) and not _is_built_in(cls):
            raise ValueError(
                f"{cls.__module__}.{cls.__qualname__}: the algorithm name {name!r} is built in "
                f"({built_in.__module__}.{built_in.__qualname__}); a class of that name would replace "
                "it in every config. Rename the class."
            )
        SparsityAlgorithm.registry[name] = cls

    def __init__(
        self,
        sparsity: Any = None,
        *,
        param_filter: None | str | Iterable[str] | ParamFilter = None,
        init_method: str | Callable[..., torch.Tensor] = "random",
        distribution: str = "uniform",
        seed: int = 0,
        tie_breaker: TieBreaker | None = None,
    ) -> None:
        if sparsity is None:
            raise ValueError(f"{type(self).__name__}: 'sparsity' is required")
        self.sparsity: Schedule = make_schedule(sparsity, cadence=self._cadence())
        if isinstance(sparsity, (int, float)):
            _check_level("sparsity", float(sparsity))
        self.param_filter = make_param_filter(param_filter)
        if not callable(init_method) and init_method not in INIT_METHODS:
            raise ValueError(f"unknown init_method {init_method!r}; known: {sorted(INIT_METHODS)}")
        self.init_method = init_method
        self.distribution = get_distribution(distribution)
        self.distribution_name = distribution
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        if tie_breaker is not None and not isinstance(tie_breaker, TieBreaker):
            raise ValueError(f"tie_breaker must be a sparsity.ScoreTieBreaker, got {tie_breaker!r}")
        self.fixed_tie_breaker = tie_breaker
        self.step = 0
        self.autoupdate = True
        self._params: list[SparseParam] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[RemovableHandle] = []
        self._target_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._computed_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._dense_grads: dict[nn.Parameter, torch.Tensor] = {}
        self._grad_handles: list[RemovableHandle] = []
        self._masked_state = {}
        self._zeros_in = {}
        self._masking_task = -1
        self._targets: dict[str, float] = {}
        self._load_hooked: set[int] = set()
        self.stats = MaskStats()

    def _cadence(self) -> UpdateSchedule | None:
        """The update cadence a cycling sparsity counts (None: the masks never change)."""
        return None

    # ----------------------------------------------------------------------------- attaching
    def apply(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        """Attach to a model (create masks and apply them) or to an optimizer (step hooks).

        Args:
            obj: The model, whose parameters the filter selects get a ``<name>_mask`` buffer
                (kept if one was loaded), or an optimizer of those parameters, after whose
                steps the algorithm counts, updates and re-masks.

        Raises:
            TypeError: ``obj`` is neither an ``nn.Module`` nor a ``torch.optim.Optimizer``.
        """
        if isinstance(obj, nn.Module):
            self._attach_model(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self._attach_optimizer(obj)
        else:
            raise TypeError(f"apply() takes an nn.Module or a torch.optim.Optimizer, got {type(obj).__name__}")

    def __call__(self, module: nn.Module) -> None:
        # nn.Module.apply(fn) calls fn on every submodule bottom-up and on the root last; masks
        # must be named relative to that root, so act once, on the outermost module being applied.
        if module is _outermost_apply_root(module):
            self.apply(module)

    def _claims(self, name: str, param: nn.Parameter, module: nn.Module) -> bool:
        if getattr(param, "requires_dense", False) or getattr(module, "requires_dense", False):
            return False
        return bool(self.param_filter(name, param))

    def _attach_model(self, model: nn.Module) -> None:
        seen: set[int] = set()
        params: list[SparseParam] = []
        for module_name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{pname}" if module_name else pname
                if id(param) in seen or not self._claims(name, param, module):
                    continue
                seen.add(id(param))
                params.append(SparseParam(name, module, pname))
        self._params = params
        self._before_first_mask(params)
        targets = self.layer_targets(self.step)
        for sp in params:
            if sp.mask_name not in sp.module._buffers:  # a loaded or re-applied mask is kept
                mask = self._initial_mask(sp, targets[sp.name])
                sp.module.register_buffer(sp.mask_name, mask, persistent=True)
            self.stats.track(sp)
        self._record_targets(targets)
        self.mask_weights()
        self._hook_gradients()
        self._hook_checkpoint_loading(model)
        self._notify_computed()

    def _hook_checkpoint_loading(self, model: nn.Module) -> None:
        """A plain ``model.load_state_dict`` reads NaN-sentinel and dense checkpoints too (see
        :func:`~sparsity.keeping.fill_missing_mask`), and after it a fixed mask is moved to the
        configured level (with a warning) if the checkpoint's is another one."""
        for sp in self._params:
            if id(sp.module) in self._load_hooked:
                continue
            self._load_hooked.add(id(sp.module))
            sp.module._register_load_state_dict_pre_hook(self._fill_missing_masks_of(sp.module))
        if id(model) not in self._load_hooked:
            self._load_hooked.add(id(model))
            model.register_load_state_dict_post_hook(lambda _module, _keys: self._after_checkpoint_load())

    def _fill_missing_masks_of(self, module: nn.Module) -> Callable[..., None]:
        def fill(state_dict: dict[str, Any], prefix: str, *_args: Any) -> None:
            for sp in self._params:
                if sp.module is module:
                    fill_missing_mask(state_dict, prefix, sp.param_name, sp.mask_name, sp.mask)
        return fill

    @torch.no_grad()
    def _after_checkpoint_load(self) -> None:
        if isinstance(self.sparsity, Constant) and not isinstance(self, DynamicSparsityAlgorithm):
            targets = self.layer_targets(self.step)
            for sp in self._params:
                wanted, kept = keep_count(sp.mask.numel(), targets[sp.name]), int(sp.mask.sum())
                if kept != wanted:
                    warnings.warn(
                        f"{sp.name}: the checkpoint's mask keeps {kept} of {sp.mask.numel()}; the configured "
                        f"sparsity {targets[sp.name]:.4f} keeps {wanted}. Moving the mask to the configured "
                        "level (smallest |w| pruned, or random positions regrown at 0).", stacklevel=3)
                    sp.mask = move_to_level(sp.param.detach(), sp.mask, wanted,
                                            self.generator(sp.name, purpose="restart"))
        self.mask_weights()

    def _before_first_mask(self, params: list[SparseParam]) -> None:
        """Called by ``apply(model)`` with the parameters claimed, before they are masked."""

    @property
    def sparse_params(self) -> dict[str, SparseParam]:
        """The masked parameters by name (cstorch's ``self.sparse_params``), in model order."""
        return {sp.name: sp for sp in self._params}

    def _attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if any(opt is optimizer for opt in self._optimizers):
            return
        self._optimizers.append(optimizer)
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        self._handles.append(optimizer.register_step_post_hook(self._after_step))

    def sparse_parameters(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """``(name, parameter, bool mask)`` of every sparse parameter, in model order."""
        return [(sp.name, sp.param, sp.mask) for sp in self._params]

    # ------------------------------------------------------------------------- the schedule
    def is_update_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` changes the masks (never, for a fixed mask)."""
        return False

    def last_update_step(self, until: int) -> int | None:
        """The last step in [1, until] that updates the masks, or None."""
        return None

    def needs_dense_grad(self) -> bool:
        """True iff the next optimizer step updates masks from the dense gradient."""
        return self.grows_by_gradient and self.is_update_step(self.step + 1)

    def target_sparsity(self, step: int) -> float:
        """The global sparsity the schedule gives at optimizer step ``step``.

        Raises:
            ValueError: The schedule's value is outside [0, 1).
        """
        value = self.sparsity.value_at(step, self.is_update_step(step))
        _check_level("sparsity", value, step)
        return value

    def layer_targets(self, step: int) -> dict[str, float]:
        """Per-parameter sparsity at ``step``: the global target spread by the distribution."""
        shapes = {sp.name: tuple(sp.param.shape) for sp in self._params}
        return self.distribution(shapes, self.target_sparsity(step)) if shapes else {}

    @abstractmethod
    def update(self) -> None:
        """Called after every optimizer step (``self.step`` already advanced) while autoupdate."""

    # ------------------------------------------------------------------------- init and rng
    def generator(self, param: nn.Parameter | str, step: int | None = None, purpose: str = "") -> torch.Generator:
        """A generator seeded by (seed, step, parameter name): deterministic on every replica.
        A ``purpose`` gives a stream of its own for the same step and parameter."""
        name = param if isinstance(param, str) else self._name_of(param)
        parts = (self.seed, self.step if step is None else step, name) + ((purpose,) if purpose else ())
        return torch.Generator().manual_seed(_mixed_seed(*parts))

    def tie_breaker(self, param: nn.Parameter) -> TieBreaker:
        """The ``tie_breaker`` given to the constructor, else a random order seeded by (seed,
        step, parameter name)."""
        if self.fixed_tie_breaker is not None:
            return self.fixed_tie_breaker
        name = self._name_of(param)
        return RandomTieBreaker(_mixed_seed(self.seed, self.step, name, "ties"))

    def dense_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The dense gradient captured before masking for this update step (summed over the
        micro-batches since the last step): a copy private to the update (RigL's ``grow_score``
        turns it into its magnitude in place)."""
        try:
            return self._dense_grads[param]
        except KeyError:
            raise RuntimeError(
                f"no dense gradient captured for {self._name_of(param)!r}: gradient-growing "
                "algorithms update inside optimizer.step() after a backward pass"
            ) from None

    def _name_of(self, param: nn.Parameter) -> str:
        for sp in self._params:
            if sp.param is param:
                return sp.name
        raise KeyError("parameter is not managed by this algorithm")

    def _initial_mask(self, sp: SparseParam, sparsity: float) -> torch.Tensor:
        method = self.init_method
        generator = self.generator(sp.name, step=0)
        if callable(method):
            mask = method(sp.param.detach(), sparsity, generator)
        else:
            mask = INIT_METHODS[method](sp.param.detach(), sparsity, generator)
        if mask.shape != sp.param.shape:
            raise ValueError(f"init_method returned shape {tuple(mask.shape)} for {sp.name} {tuple(sp.param.shape)}")
        return mask.to(dtype=torch.bool, device=sp.param.device)

    # --------------------------------------------------------------------- hooks and metrics
    def register_target_sparsity_hook(self, hook: Callable[[SparsityAlgorithm, str, float], None]) -> RemovableHandle:
        """Calls ``hook(algorithm, parameter name, target sparsity)`` for every sparse parameter
        when targets are set: at apply and on update steps. Returns a handle whose ``remove()``
        unregisters it."""
        handle = RemovableHandle(self._target_hooks)
        self._target_hooks[handle.id] = hook
        return handle

    def register_computed_sparsity_hook(self, hook: Callable[[SparsityAlgorithm, str, float], None]) -> RemovableHandle:
        """Calls ``hook(algorithm, parameter name, actual sparsity)`` for every sparse parameter
        after its masks are computed: at apply and on update steps. Returns a handle whose
        ``remove()`` unregisters it."""
        handle = RemovableHandle(self._computed_hooks)
        self._computed_hooks[handle.id] = hook
        return handle

    def _record_targets(self, targets: dict[str, float]) -> None:
        self._targets.update(targets)
        for hook in self._target_hooks.values():
            for name, value in targets.items():
                hook(self, name, value)

    def _notify_computed(self) -> None:
        if not self._computed_hooks:
            return
        for sp in self._params:
            actual = 1.0 - int(torch.count_nonzero(sp.mask)) / sp.mask.numel()
            for hook in self._computed_hooks.values():
                hook(self, sp.name, actual)

    def metrics(self) -> dict[str, float]:
        """MLflow-ready metrics: per-parameter target/actual, global sparsity, last update stats."""
        out: dict[str, float] = {}
        kept = total = 0
        for sp in self._params:
            nnz, numel = int(torch.count_nonzero(sp.mask)), sp.mask.numel()
            kept, total = kept + nnz, total + numel
            out[f"sparsity/{sp.name}/target"] = self._targets.get(sp.name, float("nan"))
            out[f"sparsity/{sp.name}/actual"] = 1.0 - nnz / numel
        if total:
            out["sparsity/global"] = 1.0 - kept / total
        out.update(MaskStats.metrics([self.stats]))
        return out

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Plain data: step, seed, last targets, mask statistics (ITOP union, last update).

        Schedules are functions of the step and generators are derived from (seed, step, name),
        so step + seed restore every schedule and random stream exactly.
        """
        return {
            "algorithm": type(self).__name__.lower(),
            "step": self.step,
            "seed": self.seed,
            "targets": dict(self._targets),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved (the input is not modified); load the model's
        own state dict, masks included, separately.

        Raises:
            ValueError: ``state_dict`` was saved by another algorithm.
        """
        state = dict(state_dict)  # never mutate the caller's dict (reference quirk 2, docs/design.md)
        expected = type(self).__name__.lower()
        if state.get("algorithm") != expected:
            raise ValueError(f"state_dict is for {state.get('algorithm')!r}, not {expected!r}")
        self.step = int(state["step"])
        self.seed = int(state["seed"])
        self._targets = dict(state["targets"])
        self.stats.load_state_dict(state["stats"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sparsity={self.sparsity!r}, step={self.step})"


class DynamicSparsityAlgorithm(SparsityAlgorithm):
    """Masks that change on update steps. Subclasses override :meth:`update_mask` only.

    After ``update_mask`` returns, weight, gradient and optimizer state are zeroed outside the
    new mask. Entries inside both masks keep their values and state (an entry dropped and
    regrown in the same update included, as in RigL's reference code and cstorch); entries
    grown from inactive hold 0 everywhere, then :meth:`initialize_grown` may set their weights.

    Args:
        sparsity: As for [`SparsityAlgorithm`][sparsity.SparsityAlgorithm].
        update: When masks change, counted in optimizer steps: an int (every that many
            steps), ``{"freq": f, "start": a, "stop": b}`` (``stop`` exclusive),
            ``{"steps": [...]}``, or a callable ``step -> bool``. Required.
        **kwargs: The options of [`SparsityAlgorithm`][sparsity.SparsityAlgorithm]
            (``param_filter``, ``init_method``, ``distribution``, ``seed``, ``tie_breaker``).

    Raises:
        ValueError: ``update`` missing (use [`Static`][sparsity.Static] for masks that never
            change) or malformed, or an invalid option of the base class.
    """

    def __init__(self, sparsity: Any = None, *, update: Any = None, **kwargs: Any) -> None:
        if update is None:
            raise ValueError(
                f"{type(self).__name__}: 'update' is required (e.g. {{'freq': 100, 'stop': 3000}}); "
                "use Static for masks that never change"
            )
        self.update_schedule = make_update_schedule(update)
        super().__init__(sparsity, **kwargs)

    def _cadence(self) -> UpdateSchedule | None:
        return self.update_schedule

    def is_update_step(self, step: int) -> bool:
        # step 0 is the initial mask, never an update (cstorch's cadences answer True there)
        return step >= 1 and self.update_schedule(step)

    def last_update_step(self, until: int) -> int | None:
        return self.update_schedule.last_update(until)

    def update_targets(self, step: int) -> dict[str, float]:
        """Per-parameter targets used by an update; GraNet overrides it for global pruning."""
        return self.layer_targets(step)

    @abstractmethod
    def update_mask(self, p: nn.Parameter, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Return the new bool mask of ``p`` at target ``sparsity`` (exact count expected)."""

    @torch.no_grad()
    def update(self, force: bool = False) -> None:
        """Update every mask if this step is an update step (or ``force``); masks change in place."""
        if not (force or self.is_update_step(self.step)):
            return
        targets = self.update_targets(self.step)
        self._record_targets(targets)
        old = {sp.name: sp.mask.clone() for sp in self._params}
        for sp in self._params:
            sp.mask.copy_(self.update_mask(sp.param, sp.mask, targets[sp.name]))
            self.zero_outside(sp.param, sp.mask)
            self.initialize_grown(sp.param, sp.mask & ~old[sp.name], old[sp.name])
        self.stats.record(old, {sp.name: sp.mask for sp in self._params})
        self._notify_computed()

    def initialize_grown(self, p: nn.Parameter, grown: torch.Tensor, old_mask: torch.Tensor) -> None:
        """Sets the weights of the entries ``grown`` from inactive by this update (bool, ``p``'s
        shape); they hold 0 when this is called, which the default keeps."""


# ------------------------------------------------------------------------------- helpers
def _check_level(field: str, value: float, step: int | None = None) -> None:
    if not 0.0 <= value < 1.0:  # NaN fails both comparisons
        where = "" if step is None else f" at step {step}"
        raise ValueError(f"{field} must be in [0, 1){where}, got {value!r}")


def _outermost_apply_root(module: nn.Module) -> nn.Module:
    root = module
    frame = sys._getframe(1)
    apply_code = nn.Module.apply.__code__
    while frame is not None:
        if frame.f_code is apply_code:
            root = frame.f_locals["self"]
        frame = frame.f_back
    return root


def _is_built_in(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "sparsity"


def algorithm_names() -> list[str]:
    """The registered algorithm names (lowercase class names) a config may use, sorted."""
    return sorted(n for n, cls in SparsityAlgorithm.registry.items() if not inspect.isabstract(cls))


def get_algorithm_class(name: str) -> type[SparsityAlgorithm]:
    """The class registered under ``name`` (any case); a ``module.ClassName`` is imported. A
    name not registered yet is looked for again after importing the ``--python_paths`` code.

    Args:
        name: A registered name such as ``"rigl"``, or ``"module.ClassName"``.

    Returns:
        The algorithm class.

    Raises:
        ValueError: The module cannot be imported, or no concrete algorithm has that name
            (the message lists the known names).
    """
    from . import plugins

    module, _, class_name = str(name).rpartition(".")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(f"algorithm {name!r}: cannot import module {module!r}: {err}") from None
    cls = SparsityAlgorithm.registry.get(class_name.lower())
    if cls is None and plugins.import_from_env():
        cls = SparsityAlgorithm.registry.get(class_name.lower())
    if cls is None or inspect.isabstract(cls):
        raise ValueError(
            f"unknown sparsity algorithm {name!r}; known: {algorithm_names()}. Register one by "
            "subclassing sparsity.SparsityAlgorithm or sparsity.DynamicSparsityAlgorithm in a "
            "module the run imports (csx run --python_paths DIR, or module.ClassName)."
        )
    return cls
