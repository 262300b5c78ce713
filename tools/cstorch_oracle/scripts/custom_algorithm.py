"""A custom dynamic sparsity algorithm written as cstorch's "Writing a custom sparsity
algorithm" guide writes one: a DynamicSparsityAlgorithm subclass whose update_mask reads the
tensor ``sparsity`` and ``self.is_update_step``, a HyperParameterSchedule subclass picked up by
its lowercase name, a ScoreShaper subclass, both built through ``cstorch.sparse.configure``.
``record`` is provided by the oracle harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")


class Cubic(cstorch.sparse.utils.HyperParameterSchedule):
    """Zhu & Gupta's cubic ramp from ``init`` to ``final`` over ``steps``."""

    def __init__(self, init, final, steps):
        super().__init__()
        self.init, self.final, self.steps = init, final, steps

    def compute(self, step):
        progress = torch.clamp(step.float() / self.steps, max=1.0)
        return self.final + (self.init - self.final) * (1 - progress) ** 3


class PairShaper(cstorch.sparse.utils.ScoreShaper):
    """Scores compete in rows of two consecutive output rows."""

    def __call__(self, tensor):
        rows = tensor.reshape(tensor.shape[0] // 2, -1)
        return rows, lambda shaped: shaped.reshape(tensor.shape)


class RandomRegrowth(cstorch.sparse.DynamicSparsityAlgorithm):
    """Prune by magnitude to the scheduled level, then swap a fraction at random."""

    def __init__(self, swap_fraction=0.25, **kwargs):
        super().__init__(**kwargs)
        self.swap_fraction = cstorch.sparse.utils.make_hyperparam_schedule(swap_fraction)
        self.shaper = PairShaper()

    @torch.no_grad()
    def update_mask(self, p, mask, sparsity):
        pruned = cstorch.sparse.utils.make_mask_topk_sparsity(p.abs() * mask, sparsity, self.shaper)
        kept, n_kept = cstorch.sparse.utils.make_mask_drop_minimum(
            p.abs(), pruned, self.swap_fraction(self.step), self.shaper)
        grown = cstorch.sparse.utils.make_mask_grow_maximum(torch.rand_like(p), kept, sparsity, n_kept, self.shaper)
        n_dense = ((1 - sparsity) * p.numel()).round()  # the tensor arithmetic a cstorch user writes
        record("n_dense", torch.where(self.is_update_step, n_dense, -1.0))
        return grown


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
sparsity = cstorch.sparse.configure({
    "algorithm": "randomregrowth",
    "sparsity": {"type": "cubic", "init": 0.2, "final": 0.8, "steps": 6},
    "swap_fraction": 0.25,
    "update": {"freq": 2, "stop": 9},
    "param_filter": "*.weight",
})
sparsity.register_target_sparsity_hook(lambda alg, name, level: record("target", [name, level]))
sparsity.register_computed_sparsity_hook(lambda alg, name, level: record("actual", [name, level]))
sparsity.apply(model)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
optimizer.apply(sparsity)
sparsity.initialize()

data = torch.Generator().manual_seed(1)
for step in range(10):
    inputs, targets = torch.randn(8, 16, generator=data), torch.randn(8, 8, generator=data)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    record("loss", loss)
    record("masks", {name: buffer for name, buffer in model.named_buffers() if name.endswith("_mask")})
    record("step", sparsity[0].step)

record("momentum_at_pruned", [
    float(optimizer.state[p]["momentum_buffer"][~mask].abs().sum())
    for p, mask in ((model[0].weight, model[0].weight_mask), (model[2].weight, model[2].weight_mask))])
record("state_dict", sparsity.state_dict())
