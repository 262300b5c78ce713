"""Every cstorch LR scheduler and weight-decay scheduler with its own arguments: the value of
each param group after construction and after each of 14 steps (each case written once, in
``cstorch.optim.scheduler``'s argument names, and built as both: ``ConstantLR(learning_rate=)``
and ``ConstantWD(val=)``); a momentum scheduler written on ``cstorch.optim.scheduler``, as a
user adds one; and an AdamW run under a learning-rate and a weight-decay schedule: losses and
weights. ``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
optim = cstorch.optim

# a case: (closed form, its arguments); a scheduler in the arguments is such a pair too
CASES = {
    "Constant": ("Constant", {"val": 0.05}),
    "Polynomial": ("Polynomial", {"initial_val": 0.1, "end_val": 0.01, "total_iters": 10, "power": 2.0}),
    "Polynomial_cycle": ("Polynomial", {"initial_val": 0.1, "end_val": 0.01, "total_iters": 5, "cycle": True}),
    "Linear": ("Linear", {"initial_val": 0.1, "end_val": 0.0, "total_iters": 8}),
    "Exponential": ("Exponential", {"initial_val": 0.1, "total_iters": 4, "decay_rate": 0.5}),
    "Exponential_staircase": ("Exponential", {"initial_val": 0.1, "total_iters": 4, "decay_rate": 0.5,
                                              "staircase": True}),
    "InverseExponentialTimeDecay": ("InverseExponentialTimeDecay", {"initial_val": 0.1, "step_exponent": 2,
                                                                    "total_iters": 5, "decay_rate": 0.3}),
    "InverseSquareRootDecay": ("InverseSquareRootDecay", {"initial_val": 0.2, "scale": 2.0, "warmup_steps": 4}),
    "CosineDecay": ("CosineDecay", {"initial_val": 0.1, "end_val": 0.01, "total_iters": 9}),
    "PiecewiseConstant": ("PiecewiseConstant", {"vals": [0.1, 0.05, 0.01], "milestones": [3, 7]}),
    "MultiStep": ("MultiStep", {"initial_val": 0.1, "gamma": 0.3, "milestones": [2, 5, 9]}),
    "Step": ("Step", {"initial_val": 0.1, "step_size": 3, "gamma": 0.5}),
    "CosineAnnealing": ("CosineAnnealing", {"initial_val": 0.1, "T_max": 6, "eta_min": 0.01}),
    "Lambda": ("Lambda", {"initial_val": 0.1}),
    "CosineAnnealingWarmRestarts": ("CosineAnnealingWarmRestarts", {"initial_val": 0.1, "T_0": 4, "eta_min": 0.02}),
    "Multiplicative": ("Multiplicative", {"initial_val": 0.1, "coefficient": 0.8}),
    "Cyclic": ("Cyclic", {"base_val": 0.01, "max_val": 0.1, "step_size_up": 3, "step_size_down": 2}),
    "Cyclic_triangular2": ("Cyclic", {"base_val": 0.01, "max_val": 0.1, "step_size_up": 2, "mode": "triangular2"}),
    "Cyclic_exp_range": ("Cyclic", {"base_val": 0.01, "max_val": 0.1, "step_size_up": 2, "mode": "exp_range",
                                    "gamma": 0.9}),
    "OneCycle": ("OneCycle", {"initial_val": 0.01, "max_val": 0.1, "total_steps": 12, "pct_start": 0.25}),
    "OneCycle_three_phase": ("OneCycle", {"initial_val": 0.01, "max_val": 0.1, "total_steps": 12,
                                          "three_phase": True, "anneal_strategy": "linear"}),
    "Sequential": ("Sequential", {"schedulers": [("Linear", {"initial_val": 0.0, "end_val": 0.1, "total_iters": 4}),
                                                 ("CosineDecay", {"initial_val": 0.1, "end_val": 0.0,
                                                                  "total_iters": 8})],
                                  "milestones": [4]}),
    "Chained": ("Chained", {"schedulers": [("Step", {"initial_val": 0.1, "step_size": 2, "gamma": 0.5}),
                                           ("Exponential", {"initial_val": 0.1, "total_iters": 3, "decay_rate": 0.9})]}),
    "ScalePerParam": ("ScalePerParam", {"scheduler": ("Linear", {"initial_val": 0.1, "end_val": 0.02,
                                                                 "total_iters": 6})}),
}
# the learning-rate schedulers' names for scheduler's arguments
AS_LEARNING_RATE = {"val": "learning_rate", "vals": "learning_rates", "initial_val": "initial_learning_rate",
                    "end_val": "end_learning_rate", "base_val": "base_lr", "max_val": "max_lr"}
KINDS = {"lr": (optim.lr_scheduler, "LR", AS_LEARNING_RATE), "weight_decay": (optim.weight_decay_scheduler, "WD", {})}


def class_name(closed_form, suffix):
    return closed_form if (closed_form, suffix) == ("CosineAnnealingWarmRestarts", "LR") else closed_form + suffix


def build(kind, optimizer, closed_form, arguments):
    module, suffix, names = KINDS[kind]
    options = {names.get(key, key): value for key, value in arguments.items()}
    if "schedulers" in options:
        options["schedulers"] = [build(kind, optimizer, *inner) for inner in options["schedulers"]]
    if "scheduler" in options:
        options["scheduler"] = build(kind, optimizer, *options["scheduler"])
    cls = getattr(module, class_name(closed_form, suffix))
    return cls(**options) if closed_form == "Chained" else cls(optimizer, **options)


for kind, (_, suffix, _) in KINDS.items():
    for case, (closed_form, arguments) in CASES.items():
        model = torch.nn.Linear(3, 2)
        optimizer = optim.SGD([{"params": [model.weight], "adjust_learning_rate": 0.5, "adjust_val": 0.5},
                               {"params": [model.bias]}], lr=1.0, weight_decay=1.0)
        scheduler = build(kind, optimizer, closed_form, arguments)
        values = [[float(g[kind]) for g in optimizer.param_groups]]
        for _ in range(14):
            optimizer.step()
            scheduler.step()
            values.append([float(g[kind]) for g in optimizer.param_groups])
        name, _, variant = case.partition("_")
        record(class_name(name, suffix) + (f"_{variant}" if variant else ""), values)


class MomentumScheduler(optim.scheduler.Scheduler):
    param_group_key = "momentum"


class CosineMomentum(MomentumScheduler, optim.scheduler.CosineDecayScheduler):
    """Momentum from 0.95 down to 0.85, as a user writes a scheduler of another value."""


model = torch.nn.Linear(3, 2)
optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.95)
momentum = CosineMomentum(optimizer, initial_val=0.95, end_val=0.85, total_iters=6)
values = [float(optimizer.param_groups[0]["momentum"])]
for _ in range(8):
    optimizer.step()
    momentum.step()
    values.append(float(optimizer.param_groups[0]["momentum"]))
record("momentum_scheduler", values)

torch.manual_seed(4)
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
optimizer = optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
learning_rate = optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.01, end_learning_rate=0.001,
                                            total_iters=8)
decay = optim.weight_decay_scheduler.CosineDecayWD(optimizer, initial_val=0.1, end_val=0.5, total_iters=8)
data = torch.Generator().manual_seed(5)
for step in range(8):
    inputs, targets = torch.randn(4, 6, generator=data), torch.randn(4, 3, generator=data)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    learning_rate.step()
    decay.step()
    record("adamw_loss", loss)
    record("adamw_groups", [float(optimizer.param_groups[0]["lr"]), float(optimizer.param_groups[0]["weight_decay"])])
record("adamw_weights", {name: p for name, p in model.named_parameters()})
