"""The optimizers beyond SGD and the Adams, with their defaults and with every option set, each
training a sparse model (RigL every other step): losses, final weights and masks, and the state
cstorch's own (Adagrad, Adamax, NAdam, Adafactor) build at construction. The ones cstorch
names after PyTorch's (Adadelta, ASGD, RAdam, RMSprop, Rprop; Muon's defaults) with cstorch's
own arguments; Adafactor's options it does not support, refused. ``record`` is provided by the
harness."""

import inspect

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
optim = cstorch.optim

CASES = {
    "adagrad_defaults": lambda params: optim.Adagrad(params),
    "adagrad_options": lambda params: optim.Adagrad(params, lr=0.05, lr_decay=0.1, weight_decay=0.01,
                                                    initial_accumulator_value=0.1, eps=1e-4),
    "adagrad_maximize": lambda params: optim.Adagrad(params, lr=0.02, maximize=True),
    "adamax_defaults": lambda params: optim.Adamax(params),
    "adamax_options": lambda params: optim.Adamax(params, lr=0.01, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.05),
    "adamax_maximize": lambda params: optim.Adamax(params, lr=0.005, maximize=True),
    "nadam_defaults": lambda params: optim.NAdam(params),
    "nadam_options": lambda params: optim.NAdam(params, lr=0.01, betas=(0.85, 0.98), eps=1e-6, weight_decay=0.02,
                                                momentum_decay=0.05),
    "adafactor_lr": lambda params: optim.Adafactor(params, lr=0.01),
    "adafactor_options": lambda params: optim.Adafactor(params, lr=0.02, eps=(1e-30, 1e-2), clip_threshold=1.0,
                                                        decay_rate=-0.6, beta1=None, weight_decay=0.01,
                                                        scale_parameter=False, relative_step=False,
                                                        warmup_init=False),
    "adadelta_defaults": lambda params: optim.Adadelta(params),
    "adadelta_options": lambda params: optim.Adadelta(params, lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.01),
    "asgd_defaults": lambda params: optim.ASGD(params),
    "asgd_options": lambda params: optim.ASGD(params, lr=0.05, lambd=1e-3, alpha=0.5, t0=3, weight_decay=0.01),
    "radam_defaults": lambda params: optim.RAdam(params),
    "radam_options": lambda params: optim.RAdam(params, lr=0.01, betas=(0.8, 0.99), eps=1e-4, weight_decay=0.01),
    "rmsprop_defaults": lambda params: optim.RMSprop(params),
    "rmsprop_options": lambda params: optim.RMSprop(params, lr=0.005, alpha=0.9, eps=1e-6, weight_decay=0.01,
                                                    momentum=0.5, centered=True),
    "rprop_defaults": lambda params: optim.Rprop(params),
    "rprop_options": lambda params: optim.Rprop(params, lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0)),
}
BUILT_UP_FRONT = ("adagrad", "adamax", "nadam", "adafactor")  # the state PyTorch's build lazily: see
# deliberate_differences.py

# the Adafactor options cstorch names but does not support (yet): refused by name
REFUSED = {"clip_threshold": {"clip_threshold": 0.5}, "beta1": {"beta1": 0.9},
           "relative_step": {"lr": None, "relative_step": True}, "warmup_init": {"warmup_init": True},
           "eps": {"eps": (1e-30, 1)}, "lr_and_relative_step": {"relative_step": True}}
for option, kwargs in REFUSED.items():
    try:
        optim.Adafactor(torch.nn.Linear(2, 2).parameters(), **{"lr": 0.01, **kwargs})
        record(f"adafactor_refuses/{option}", "accepted")
    except ValueError as error:
        record(f"adafactor_refuses/{option}", type(error).__name__)
# Muon's arguments and defaults (its steps: deliberate_differences.py)
muon = optim.Muon(torch.nn.Linear(4, 4, bias=False).parameters())
record("muon/defaults", {k: v for k, v in muon.defaults.items() if k in inspect.signature(type(muon).__init__).parameters})

for case, make in CASES.items():
    torch.manual_seed(17)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 4))
    sparsity = cstorch.sparse.RigL(sparsity=0.5, drop_fraction=0.3, update={"freq": 2})
    sparsity.apply(model)
    optimizer = make(model.parameters())
    optimizer.apply(sparsity)
    sparsity.initialize()
    named = inspect.signature(type(optimizer).__init__).parameters
    record(f"{case}/defaults", {k: v for k, v in optimizer.defaults.items() if k in named})
    if case.startswith(BUILT_UP_FRONT):
        record(f"{case}/state_keys", sorted(optimizer.state[model[0].weight]))
    data = torch.Generator().manual_seed(18)
    for step in range(12):
        inputs, targets = torch.randn(16, 10, generator=data), torch.randn(16, 4, generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        record(f"{case}/loss", loss)
    record(f"{case}/weights", {name: p for name, p in model.named_parameters()})
    record(f"{case}/masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
