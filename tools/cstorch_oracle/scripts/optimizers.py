"""The optimizers whose arithmetic cstorch defines itself beyond SGD and the Adams: Adagrad,
Adamax and NAdam, with their defaults and with every option set, each training a sparse model
(RigL every other step): losses, final weights and the state each keeps. ``record`` is
provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")

CASES = {
    "adagrad_defaults": lambda params: cstorch.optim.Adagrad(params),
    "adagrad_options": lambda params: cstorch.optim.Adagrad(params, lr=0.05, lr_decay=0.1, weight_decay=0.01,
                                                            initial_accumulator_value=0.1, eps=1e-4),
    "adagrad_maximize": lambda params: cstorch.optim.Adagrad(params, lr=0.02, maximize=True),
    "adamax_defaults": lambda params: cstorch.optim.Adamax(params),
    "adamax_options": lambda params: cstorch.optim.Adamax(params, lr=0.01, betas=(0.8, 0.99), eps=1e-3,
                                                          weight_decay=0.05),
    "adamax_maximize": lambda params: cstorch.optim.Adamax(params, lr=0.005, maximize=True),
    "nadam_defaults": lambda params: cstorch.optim.NAdam(params),
    "nadam_options": lambda params: cstorch.optim.NAdam(params, lr=0.01, betas=(0.85, 0.98), eps=1e-6,
                                                        weight_decay=0.02, momentum_decay=0.05),
}

for case, make in CASES.items():
    torch.manual_seed(17)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 4))
    sparsity = cstorch.sparse.RigL(sparsity=0.5, drop_fraction=0.3, update={"freq": 2})
    sparsity.apply(model)
    optimizer = make(model.parameters())
    optimizer.apply(sparsity)
    sparsity.initialize()
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
