"""Stateful sparsity schedules shared by several parameters, written as cstorch's own
``Cycling`` is: a HyperParameterSchedule subclass that keeps its state in ``update()``. A
schedule advances once per optimizer step (and once at ``apply``) however many parameters share
it, also when a subclass of ``Cycling`` extends ``update`` through ``super()``. ``record`` is
provided by the oracle harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")


class Staircase(cstorch.sparse.utils.HyperParameterSchedule):
    """``start`` raised by ``rise`` at every update step, up to ``top``."""

    def __init__(self, start, rise, top):
        super().__init__()
        self.start, self.rise, self.top = start, rise, top
        self.climbed = torch.tensor(0, dtype=torch.int64)

    def compute(self, step):
        return torch.clamp(self.start + self.rise * self.climbed.float(), max=self.top)

    def update(self, is_update_step):
        self.climbed = self.climbed + is_update_step.long()

    def state_dict(self):
        return {"climbed": self.climbed}


class CountedCycling(cstorch.sparse.utils.Cycling):
    """Cycling that counts how often its ``update`` runs."""

    def __init__(self, values):
        super().__init__(values)
        self.calls = 0

    def update(self, is_update_step):
        self.calls += 1
        super().update(is_update_step)


def three_layers():
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 6))


CASES = {
    # configured by name: one Staircase shared by the three weights
    "gmp_configured_staircase": lambda: cstorch.sparse.configure({
        "algorithm": "gmp", "sparsity": {"type": "staircase", "start": 0.2, "rise": 0.05, "top": 0.8},
        "param_filter": "*.weight"}),
    # an instance shared by all six parameters (biases included), masks changing every other step
    "set_shared_staircase": lambda: cstorch.sparse.SET(sparsity=Staircase(0.3, 0.1, 0.9), drop_fraction=0.25,
                                                       update={"freq": 2}),
    "rigl_counted_cycling": lambda: cstorch.sparse.RigL(sparsity=CountedCycling([0.3, 0.5, 0.7, 0.6]),
                                                        update={"freq": 1, "stop": 7}),
}

for case, make in CASES.items():
    torch.manual_seed(5)
    model = three_layers()
    sparsity = make()
    algorithm = sparsity[0] if isinstance(sparsity, cstorch.sparse.Group) else sparsity
    sparsity.register_target_sparsity_hook(lambda alg, name, level, case=case: record(f"{case}/target", [name, level]))
    sparsity.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.apply(sparsity)
    sparsity.initialize()
    schedule = next(iter(algorithm.sparsity.values()))

    def progress():
        return {"climbed": schedule.climbed} if isinstance(schedule, Staircase) else {
            "index": schedule.index, "calls": schedule.calls}

    record(f"{case}/after_apply", progress())
    record(f"{case}/initial", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
    data = torch.Generator().manual_seed(6)
    for step in range(9):
        inputs, targets = torch.randn(8, 10, generator=data), torch.randn(8, 6, generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        record(f"{case}/loss", loss)
        record(f"{case}/progress", progress())
        record(f"{case}/masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
    record(f"{case}/state_dict", sparsity.state_dict())
