"""Checkpoints as cstorch users load them: a model state dict with ``<param>_mask`` buffers
loaded with plain ``model.load_state_dict`` into a fresh model and algorithm, masks kept by
``initialize()``, the algorithm's own state restored, training going on. ``record`` is provided
by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    sparsity = cstorch.sparse.configure([
        {"algorithm": "set", "sparsity": 0.6, "drop_fraction": 0.25, "update": {"freq": 2}, "param_filter": "0.weight"},
        {"algorithm": "static", "sparsity": 0.5, "param_filter": "2.weight"},
    ])
    sparsity.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.apply(sparsity)
    return model, sparsity, optimizer


def train(model, optimizer, steps, label):
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        inputs, labels = torch.randn(12, 10, generator=generator), torch.randint(0, 3, (12,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        record(f"{label}_loss", loss)


model, sparsity, optimizer = build(1)
sparsity.initialize()
train(model, optimizer, range(5), "before")
cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sparsity": sparsity.state_dict()},
             "checkpoint.mdl")
record("saved_masks", {k: v for k, v in model.state_dict().items() if k.endswith("_mask")})
record("saved_keys", sorted(model.state_dict()))
record("saved_sparsity", sparsity.state_dict())

torch.manual_seed(2)
model, sparsity, optimizer = build(2)
state = cstorch.load("checkpoint.mdl")
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
sparsity.load_state_dict(state["sparsity"])
sparsity.initialize()
record("loaded_masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
record("loaded_step", [s["step"] for s in sparsity.state_dict() if "step" in s])
train(model, optimizer, range(5, 9), "after")
record("final_masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
