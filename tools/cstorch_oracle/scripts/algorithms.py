"""Every algorithm, init method, schedule type and update cadence, one small model each,
trained with cstorch's SGD: masks after every step, hooks, state dicts. ``record`` is provided
by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")

CASES = {
    "static_random": lambda: cstorch.sparse.Static(sparsity=0.6),
    "static_topk": lambda: cstorch.sparse.Static(sparsity=0.5, init_method="topk"),
    "static_checkerboard": lambda: cstorch.sparse.Static(sparsity=0.75, init_method="checkerboard"),
    "gmp_linear": lambda: cstorch.sparse.GMP(sparsity={"type": "linear", "init": 0.1, "slope": 0.1}),
    "gmp_exp": lambda: cstorch.sparse.GMP(sparsity={"type": "exp", "init": 0.0, "gamma": -0.5, "final": 0.9},
                                          update={"freq": 2}),
    "gmp_power": lambda: cstorch.sparse.GMP(sparsity={"type": "power", "init": 0.5, "beta": 1.1},
                                            update={"steps": [0, 3, 5]}),
    "gmp_cosine": lambda: cstorch.sparse.GMP(sparsity={"type": "cosine", "init": 0.8, "half_period": 4,
                                                       "minimum": 0.4}),
    "gmp_cycling": lambda: cstorch.sparse.GMP(sparsity=[0.2, 0.4, 0.6], update={"steps": [0, 2, 4]}),
    "set_every_step": lambda: cstorch.sparse.SET(sparsity=0.5),
    "set_dense_start": lambda: cstorch.sparse.SET(sparsity=0.6, drop_fraction=0.4,
                                                  update={"freq": 2, "start": 2, "stop": 7}),
    "rigl": lambda: cstorch.sparse.RigL(sparsity=0.7, drop_fraction=0.5, update={"freq": 3}),
    "configured_rigl_in_groups": lambda: cstorch.sparse.configure(
        {"algorithm": "rigl", "sparsity": 0.5, "balance_in_groups": 4, "param_filter": "*.weight"}),
    "configured_group": lambda: cstorch.sparse.configure([
        {"algorithm": "set", "sparsity": 0.5, "param_filter": "0.*"},
        {"algorithm": "gmp", "schedule": [0.1, 0.3], "update": {"freq": 2}, "param_filter": "2.weight"},
    ]),
    "configured_default_filter": lambda: cstorch.sparse.configure(
        {"groups": [{"params": {"algorithm": "rigl", "sparsity": 0.6}}]}),
}

for case, make in CASES.items():
    torch.manual_seed(21)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    sparsity = make()
    sparsity.register_target_sparsity_hook(lambda alg, name, level, case=case: record(f"{case}/target", [name, level]))
    sparsity.register_computed_sparsity_hook(lambda alg, name, level, case=case: record(f"{case}/actual", [name, level]))
    sparsity.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    optimizer.apply(sparsity)
    sparsity.initialize()
    record(f"{case}/initial", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
    data = torch.Generator().manual_seed(2)
    for step in range(7):
        inputs, targets = torch.randn(8, 12, generator=data), torch.randn(8, 8, generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        record(f"{case}/loss", loss)
        record(f"{case}/masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
    record(f"{case}/state_dict", sparsity.state_dict())
    record(f"{case}/model_keys", sorted(model.state_dict()))
