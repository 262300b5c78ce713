"""Every cstorch LR scheduler with its own arguments: the learning rate after construction
and after each of 14 steps, and the ``configure``-style sequences ModelZoo builds. ``record``
is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
lr = cstorch.optim.lr_scheduler

SCHEDULERS = {
    "ConstantLR": lambda o: lr.ConstantLR(o, learning_rate=0.05),
    "PolynomialLR": lambda o: lr.PolynomialLR(o, initial_learning_rate=0.1, end_learning_rate=0.01, total_iters=10,
                                              power=2.0),
    "PolynomialLR_cycle": lambda o: lr.PolynomialLR(o, initial_learning_rate=0.1, end_learning_rate=0.01,
                                                    total_iters=5, cycle=True),
    "LinearLR": lambda o: lr.LinearLR(o, initial_learning_rate=0.1, end_learning_rate=0.0, total_iters=8),
    "ExponentialLR": lambda o: lr.ExponentialLR(o, initial_learning_rate=0.1, total_iters=4, decay_rate=0.5),
    "ExponentialLR_staircase": lambda o: lr.ExponentialLR(o, initial_learning_rate=0.1, total_iters=4,
                                                          decay_rate=0.5, staircase=True),
    "InverseExponentialTimeDecayLR": lambda o: lr.InverseExponentialTimeDecayLR(
        o, initial_learning_rate=0.1, step_exponent=2, total_iters=5, decay_rate=0.3),
    "InverseSquareRootDecayLR": lambda o: lr.InverseSquareRootDecayLR(o, initial_learning_rate=0.2, scale=2.0,
                                                                      warmup_steps=4),
    "CosineDecayLR": lambda o: lr.CosineDecayLR(o, initial_learning_rate=0.1, end_learning_rate=0.01, total_iters=9),
    "PiecewiseConstantLR": lambda o: lr.PiecewiseConstantLR(o, learning_rates=[0.1, 0.05, 0.01], milestones=[3, 7]),
    "MultiStepLR": lambda o: lr.MultiStepLR(o, initial_learning_rate=0.1, gamma=0.3, milestones=[2, 5, 9]),
    "StepLR": lambda o: lr.StepLR(o, initial_learning_rate=0.1, step_size=3, gamma=0.5),
    "CosineAnnealingLR": lambda o: lr.CosineAnnealingLR(o, initial_learning_rate=0.1, T_max=6, eta_min=0.01),
    "LambdaLR": lambda o: lr.LambdaLR(o, initial_learning_rate=0.1),
    "CosineAnnealingWarmRestarts": lambda o: lr.CosineAnnealingWarmRestarts(o, initial_learning_rate=0.1, T_0=4,
                                                                            eta_min=0.02),
    "MultiplicativeLR": lambda o: lr.MultiplicativeLR(o, initial_learning_rate=0.1, coefficient=0.8),
    "CyclicLR": lambda o: lr.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3, step_size_down=2),
    "CyclicLR_triangular2": lambda o: lr.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="triangular2"),
    "CyclicLR_exp_range": lambda o: lr.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="exp_range",
                                                gamma=0.9),
    "OneCycleLR": lambda o: lr.OneCycleLR(o, initial_learning_rate=0.01, max_lr=0.1, total_steps=12, pct_start=0.25),
    "OneCycleLR_three_phase": lambda o: lr.OneCycleLR(o, initial_learning_rate=0.01, max_lr=0.1, total_steps=12,
                                                      three_phase=True, anneal_strategy="linear"),
    "SequentialLR": lambda o: lr.SequentialLR(o, [lr.LinearLR(o, initial_learning_rate=0.0, end_learning_rate=0.1,
                                                              total_iters=4),
                                                  lr.CosineDecayLR(o, initial_learning_rate=0.1,
                                                                   end_learning_rate=0.0, total_iters=8)],
                                              milestones=[4]),
    "ChainedLR": lambda o: lr.ChainedLR([lr.StepLR(o, initial_learning_rate=0.1, step_size=2, gamma=0.5),
                                         lr.ExponentialLR(o, initial_learning_rate=0.1, total_iters=3,
                                                          decay_rate=0.9)]),
    "ScalePerParamLR": lambda o: lr.ScalePerParamLR(o, lr.LinearLR(o, initial_learning_rate=0.1,
                                                                   end_learning_rate=0.02, total_iters=6)),
}

for name, make in SCHEDULERS.items():
    model = torch.nn.Linear(3, 2)
    optimizer = cstorch.optim.SGD([{"params": [model.weight], "adjust_learning_rate": 0.5},
                                   {"params": [model.bias]}], lr=1.0)
    scheduler = make(optimizer)
    values = [[float(g["lr"]) for g in optimizer.param_groups]]
    for _ in range(14):
        optimizer.step()
        scheduler.step()
        values.append([float(g["lr"]) for g in optimizer.param_groups])
    record(name, values)
