"""Gradient accumulation and manual updates: RigL's dense gradient summed over two
micro-batches per step (``zero_grad(set_to_none=False)`` on odd steps), and a SET run with
``autoupdate = False`` whose script calls ``sparsity.update(optimizer)`` itself every other
step. ``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")


def micro_batches(step):
    generator = torch.Generator().manual_seed(50 + step)
    return [(torch.randn(4, 12, generator=generator), torch.randn(4, 6, generator=generator)) for _ in range(2)]


torch.manual_seed(8)
model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Sigmoid(), torch.nn.Linear(24, 6))
rigl = cstorch.sparse.RigL(sparsity=0.6, drop_fraction=0.4, update={"freq": 2})
rigl.apply(model)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.2, momentum=0.8, nesterov=True)
optimizer.apply(rigl)
rigl.initialize()
for step in range(8):
    optimizer.zero_grad(set_to_none=bool(step % 2 == 0))
    for inputs, targets in micro_batches(step):
        loss = torch.nn.functional.mse_loss(model(inputs), targets) / 2
        loss.backward()
        record("rigl_loss", loss)
    optimizer.step()
    record("rigl_masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})

torch.manual_seed(9)
model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Sigmoid(), torch.nn.Linear(24, 6))
sparsity = cstorch.sparse.SET(sparsity=0.5, drop_fraction=0.5)
sparsity.autoupdate = False
sparsity.apply(model)
optimizer = cstorch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
optimizer.apply(sparsity)
sparsity.initialize()
for step in range(8):
    optimizer.zero_grad()
    inputs, targets = micro_batches(step)[0]
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    if step % 2:
        sparsity.update(optimizer)
    record("set_loss", loss)
    record("set_step", sparsity.step)
    record("set_masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
