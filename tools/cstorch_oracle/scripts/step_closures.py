"""Step closures called inside a traced step before and after ``optimizer.step()``: each logs
what its arguments held when it was called (tensors are copied when the closure is queued),
not what they hold when the closure runs at the end of the step; nested lists and dicts of
tensors too. ``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
torch.manual_seed(13)
with backend.device:
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
compiled_model = cstorch.compile(model, backend)
sparsity = cstorch.sparse.RigL(sparsity=0.5, drop_fraction=0.3, update={"freq": 2})
model.apply(sparsity)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
optimizer.apply(sparsity)


@cstorch.step_closure
def log_before_step(loss, step, weights, named):
    record("before/loss", loss)
    record("before/step", step)
    record("before/weights", weights)
    record("before/named", named)


@cstorch.step_closure
def log_after_step(step, weight, mask):
    record("after/step", step)
    record("after/weight", weight)
    record("after/mask", mask)


@cstorch.trace
def training_step(inputs, targets):
    loss = torch.nn.functional.mse_loss(compiled_model(inputs), targets)
    loss.backward()
    log_before_step(loss, sparsity.step, [model[0].weight, model[2].bias],
                    {"mask": model[0].weight_mask, "scale": 2.0})
    optimizer.step()
    optimizer.zero_grad()
    log_after_step(sparsity.step, model[0].weight, model[0].weight_mask)
    return loss


def input_fn():
    generator = torch.Generator().manual_seed(14)
    dataset = torch.utils.data.TensorDataset(torch.randn(24, 6, generator=generator),
                                             torch.randn(24, 3, generator=generator))
    return torch.utils.data.DataLoader(dataset, batch_size=4)


executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn), num_steps=5)
for inputs, targets in executor:
    training_step(inputs, targets)
