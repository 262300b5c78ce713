"""Building one rank's run from a job's plan: its data, the model with its sparsity algorithm,
the optimizer and its LR schedule (the model and algorithm also for training/report.py's
plan, on the meta device)."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from csx_config import OptimizerSpec
from csx_config.schedulers import learning_rate_at
from models.config import ModelConfig
from models.mup import learning_rate_scale, lr_adjustment_scales
from models.transformer import Transformer, build_model
from training.data import load_data
from training.hdf5 import HDF5BatchSampler
from training.plan import JobPlan, LoopSettings, with_defaults
from training.precision import Precision, resolve_precision
from training.text import BatchSampler


@dataclass
class Run:
    """Everything one rank holds during a job."""
    settings: LoopSettings
    model: torch.nn.Module  # masked linears become the fabric's CSR layers in place (_compile)
    alg: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: BatchSampler | HDF5BatchSampler
    eval_data: Any  # (inputs, targets) batches: a list, or training.hdf5.HDF5EvalBatches
    config_dict: dict[str, Any]
    tokenizer_json: dict[str, Any]
    device: torch.device = torch.device("cpu")
    precision: Precision = Precision()
    scaler: torch.amp.GradScaler | None = None
    torch_compile: bool = False  # the model's forward through torch.compile (after the fabric swap)
    step: int = 0
    phase_start: int = 0  # the step this training phase began; it ends max_steps later
    end_step: int = 0
    best_eval_loss: float = math.inf
    mask_hashes: list[list[Any]] = field(default_factory=list)
    router_loads: list[torch.Tensor] = field(default_factory=list)  # per step since the last log (MoE)
    skipped_checkpoints: list[str] = field(default_factory=list)  # damaged ones a resume passed over
    warnings: list[str] = field(default_factory=list)


def build_run(plan: JobPlan, model_dir: Path, rank: int, device: torch.device) -> Run:
    """This rank's run of `plan`: its data, the model with its masks on `device`, optimizer,
    LR schedule, precision and the loop's settings."""
    # Dropout draws from the global generator, which torch seeds at random in every process:
    # seeded per run and replica, the same seed gives the same losses (a resume then restores
    # the checkpoint's generator state over this one).
    torch.manual_seed(plan.seed * 1_000_003 + rank)
    data = load_data(plan.data, model_dir, rank=rank, world_size=plan.num_csx, save_tokenizer_file=rank == 0)
    config = replace(plan.model, vocab_size=data.vocab_size)
    model, alg = build_sparse_model(config, plan.sparsity, seed=plan.seed)
    model.to(device)  # in place: the algorithm's parameters and mask buffers move with it
    model.use_one_qkv_matmul(device.type == "cuda")  # CPU runs keep ModelZoo's three products
    precision = resolve_precision(*plan.precision_keys, device)
    optimizer = make_optimizer(plan.optimizer, model, plan.optimizer.adjust_learning_rate,
                               loss_scaled=precision.loss_scale is not None)
    if alg is not None:
        alg.apply(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(plan.optimizer))
    return Run(settings=plan.loop, model=model, alg=alg, optimizer=optimizer,
               scheduler=scheduler, sampler=data.sampler, eval_data=data.eval_data,
               config_dict=asdict(config), tokenizer_json=data.tokenizer_json,
               device=device, precision=precision, scaler=precision.scaler(device),
               torch_compile=compiles(plan.loop.torch_compile, device,
                                      fabric_layers(alg is not None, plan.loop.sparse_kernel, device)),
               end_step=plan.loop.max_steps)


def fabric_layers(sparse: bool, sparse_kernel: str, device: torch.device) -> bool:
    """Whether the simulated fabric's CSR layers take the masked linears' place
    (training.fabric.compile_run): in a sparse run off CUDA, and on CUDA where ``sparse_kernel`` forces
    csr. On CUDA auto and dense run masked dense (docs/design.md §1): the masked linear as it is,
    its weights kept at 0 off the mask by the sparsity hooks."""
    return sparse and (device.type != "cuda" or sparse_kernel == "csr")


def compiles(setting: bool | str, device: torch.device, fabric: bool) -> bool:
    """``runconfig.torch_compile``: "auto" compiles on CUDA (nanoGPT's step: ~1.4x faster there,
    shared/research/gpu_anchors.md) unless the fabric's layers run, which torch.compile cannot
    trace (they read their masks' versions on every call)."""
    if setting == "auto":
        return device.type == "cuda" and not fabric
    if setting and fabric:
        raise ValueError("runconfig.torch_compile: true cannot trace the simulated fabric's CSR "
                         "layers, which run every sparse layer on a CPU and on CUDA with "
                         "runconfig.sparse_kernel: csr; train dense, or on CUDA with "
                         "sparse_kernel auto or dense")
    return bool(setting)


def build_sparse_model(config: ModelConfig, sparsity_section: Any, *, seed: int, device: str | None = None
                       ) -> tuple[Transformer, Any]:
    """The model (seeded by `seed`; shapes only on ``device="meta"``) and, with a sparsity
    section, the configured algorithm applied to it (masks exist on return)."""
    model = build_model(config, seed=seed, device=device)
    if sparsity_section is None:
        return model, None
    import sparsity

    algorithm = sparsity.configure(sparsity_section)  # checks the section as written
    if device == "meta":
        # A meta tensor has no values to draw a mask from: masks of the right shape only;
        # plans read the per-layer targets, never the masks.
        algorithm = sparsity.configure(with_defaults(sparsity_section, {"init_method": _shape_only_mask},
                                                     override=True))
    algorithm.apply(model)
    return model, algorithm


def _shape_only_mask(param: torch.Tensor, _sparsity: float, _generator: torch.Generator) -> torch.Tensor:
    # empty, not ones_like: meta has no values, and ones_like runs torch's Python reference
    return torch.empty(param.shape, dtype=torch.bool, device=param.device)


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The torch.optim class ModelZoo's ``optimizer_type`` names (any case: AdamW, adamw, SGD)."""
    classes = {n.lower(): c for n, c in vars(torch.optim).items()
               if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    if name.lower() not in classes:
        raise ValueError(f"optimizer.optimizer_type {name!r} is not a torch.optim optimizer; choose one of "
                         f"{sorted(c.__name__ for c in classes.values())}")
    return classes[name.lower()]


def make_optimizer(spec: OptimizerSpec, model: torch.nn.Module,
                   adjust_learning_rate: dict[str, float] | None = None,
                   loss_scaled: bool = False) -> torch.optim.Optimizer:
    """Weight decay only on tensors with >= 2 dims (nanoGPT); options the spec sets must be
    accepted by the chosen class; torch's fused kernel where ``fused_kernel`` says. The
    learning rate is 1.0 here, times each parameter's muP / ``adjust_learning_rate`` factor
    (``models.mup.lr_adjustment_scales``): ``lr_lambda`` gives the absolute rate of every
    step."""
    cls = optimizer_class(spec.optimizer_type)
    accepted = inspect.signature(cls.__init__).parameters
    options = spec.extra_kwargs()
    if spec.weight_decay:
        options["weight_decay"] = spec.weight_decay
    for option in options:
        if option not in accepted:
            raise ValueError(f"optimizer.{option} is not an option of torch.optim.{cls.__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if "fused" in accepted and "fused" not in options and fused_kernel(cls, params, loss_scaled):
        options["fused"] = True
    if "weight_decay" in options:
        groups: list[dict[str, Any]] = [{"params": [p for p in params if p.dim() >= 2]},
                                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params}]
    return cls(_with_lr_scales(groups, model, adjust_learning_rate), lr=1.0, **options)


# torch's fused optimizer kernels on CUDA (Adagrad's is the CPU's alone).
FUSED_ON_CUDA = frozenset({torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD})


def fused_kernel(cls: type[torch.optim.Optimizer], params: list[torch.Tensor],
                 loss_scaled: bool = False) -> bool:
    """Whether ``cls`` steps ``params`` (all floating point) with torch's fused kernel: on a CPU
    every class that has one (Adam, AdamW, SGD, Adagrad): bit-deterministic and, unlike the
    default foreach path, without a slow path on the exact zeros a masked run keeps in its state
    (bench/masked_overhead.py: 1.09x vs 1.01x of dense at 80% RigL); on CUDA Adam, AdamW and SGD
    (one kernel launch for many tensors, where foreach takes several and the per-tensor loop
    one each: the GPU step is the host's launches, shared/research/gpu_anchors.md), unless
    loss scaling is on: GradScaler hands a fused step the overflow flag instead of skipping it,
    so the sparsity hooks would count, and update masks on, the steps it skips."""
    if not params or not all(p.is_floating_point() for p in params):
        return False
    devices = {p.device.type for p in params}
    if devices == {"cpu"}:
        return True
    return devices == {"cuda"} and cls in FUSED_ON_CUDA and not loss_scaled


def _with_lr_scales(groups: list[dict[str, Any]], model: torch.nn.Module,
                    adjust: dict[str, float] | None) -> list[dict[str, Any]]:
    """``groups`` with the parameters whose learning rate is scaled moved into groups of their
    own whose base rate is the scale (LambdaLR multiplies it by the schedule's rate).
    Unscaled parameters keep the first groups, so param_groups[0] has the schedule's rate."""
    config = getattr(model, "built", None)
    if config is None:
        return groups
    scales = lr_adjustment_scales(config, adjust)
    names = {id(p): name for name, p in model.named_parameters()}
    scaled: list[dict[str, Any]] = []
    for group in groups:
        by_scale: dict[float, list[torch.nn.Parameter]] = {}
        for p in group["params"]:
            by_scale.setdefault(learning_rate_scale(scales, names[id(p)]), []).append(p)
        group["params"] = by_scale.pop(1.0, [])
        scaled += [{**group, "params": ps, "lr": scale} for scale, ps in by_scale.items()]
    return groups + scaled


def lr_lambda(spec: OptimizerSpec) -> Callable[[int], float]:
    """LambdaLR function (base rate 1.0) for the step about to be taken (``step`` steps taken
    so far): ModelZoo's ``learning_rate``, a number or a scheduler sequence."""
    rate = spec.learning_rate
    return lambda step: learning_rate_at(rate, step)
