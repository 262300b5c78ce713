"""Every schedule type in each form a config or a script writes it (a number, each
``{"type": ...}`` dict, a list and a tuple for cycling, a callable, an instance): its value at
steps from 0 to 42000 (``values/<case>``, the form as ``spec/<case>``), and the level GMP reads from it at each of 9 steps
under four cadences (``levels/<case>/<cadence>``), which tests/sparsity/test_schedules_oracle.py
replays through the YAML path. ``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
utils = cstorch.sparse.utils

STEPS = [0, 1, 2, 3, 5, 8, 13, 100, 1000, 4999, 42000]
SCHEDULES = {
    "number": 0.3,
    "constant": {"type": "constant", "value": 0.7},
    "linear": {"type": "linear", "init": 0.1, "slope": 0.01},
    "linear_falling": {"type": "linear", "init": 0.9, "slope": -0.0002},
    "exp_gmp": {"type": "exp", "init": 0, "gamma": -0.0001, "final": 0.8},
    "exp_default_final": {"type": "exp", "init": 0.2, "gamma": -0.01},
    "power": {"type": "power", "init": 0.9, "beta": 0.9999977},
    "power_rising": {"type": "power", "init": 0.05, "beta": 1.5},
    "cosine": {"type": "cosine", "init": 0.3, "half_period": 1000},
    "cosine_minimum": {"type": "cosine", "init": 0.8, "half_period": 4, "minimum": 0.4},
    "cycling_list": [0.2, 0.4, 0.6],
    "cycling_tuple": (0.1, 0.5),
    "cycling_dict": {"type": "cycling", "values": [0.3, 0.6]},
    "lambda_dict": {"type": "lambda", "fn": lambda step: 0.5 * (1 - torch.exp(-step / 100.0))},
    "instance": utils.Linear(init=0.25, slope=0.001),
}
for case, spec in SCHEDULES.items():
    if not isinstance(spec, utils.HyperParameterSchedule) and not (isinstance(spec, dict) and "fn" in spec):
        record(f"spec/{case}", spec)  # a config's form (plain data): a replay reads it from here
    schedule = utils.make_hyperparam_schedule(spec)
    record(f"values/{case}", [schedule(torch.tensor(step)) for step in STEPS])

# the level an algorithm reads at each step: sparsity schedules below 1 over these steps
LEVEL_SCHEDULES = ["linear", "linear_falling", "exp_gmp", "exp_default_final", "power", "cosine",
                   "cosine_minimum", "cycling_list", "cycling_tuple", "cycling_dict", "lambda_dict"]
CADENCES = {"every_2": {"freq": 2}, "from_1_every_3": {"freq": 3, "start": 1, "stop": 8},
            "listed": {"steps": [0, 3, 5]}, "listed_late": {"steps": [2, 6]}}
for case in LEVEL_SCHEDULES:
    for cadence_name, cadence in CADENCES.items():
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4))
        spec = SCHEDULES[case]
        sparsity = cstorch.sparse.GMP(sparsity=spec, update=cadence)
        key = f"levels/{case}/{cadence_name}"
        sparsity.register_target_sparsity_hook(lambda alg, name, level, key=key: record(key, level))
        sparsity.apply(model)
        optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.apply(sparsity)
        sparsity.initialize()
        record(f"{key}/initial_kept", model[0].weight_mask.sum())
        for step in range(9):
            optimizer.zero_grad()
            model(torch.randn(3, 6)).sum().backward()
            optimizer.step()
