"""A resume from a checkpoint holding numpy values, as research scripts save them (numpy's RNG
state, torch's as a numpy array, an ``np.int64`` epoch, an ``np.float32`` best loss, an array of
losses) beside the model, optimizer and sparsity state: ``cstorch.save``, ``cstorch.load`` into a
fresh model, both RNG streams restored, three more SET steps on numpy-drawn data, compared with
the run that never stopped. ``record`` is provided by the harness."""

import numpy as np
import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    sparsity = cstorch.sparse.SET(sparsity=0.5, drop_fraction=0.3)
    sparsity.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer.apply(sparsity)
    return model, sparsity, optimizer


def train(model, optimizer, steps, label):
    losses = []
    for _ in range(steps):
        inputs = torch.from_numpy(np.random.randn(5, 6).astype(np.float32))
        targets = torch.from_numpy(np.random.randn(5, 3).astype(np.float32))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        record(f"{label}_loss", loss)
        losses.append(float(loss))
    record(f"{label}_masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
    return losses


np.random.seed(4)
model, sparsity, optimizer = build(4)
sparsity.initialize()
history = train(model, optimizer, 3, "first")
cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sparsity": sparsity.state_dict(),
              "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state().numpy(), "epoch": np.int64(3),
              "best_loss": np.float32(min(history)), "history": np.array(history)}, "resume.mdl")
train(model, optimizer, 3, "uninterrupted")

np.random.seed(5)
model, sparsity, optimizer = build(5)
state = cstorch.load("resume.mdl")
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
sparsity.load_state_dict(state["sparsity"])
sparsity.initialize()
np.random.set_state(state["numpy_rng"])
torch.set_rng_state(torch.from_numpy(np.asarray(state["torch_rng"])))
# the reference returns a numpy scalar as a DeferredObject, whose ``value`` is the scalar
record("epoch", int(getattr(state["epoch"], "value", state["epoch"])))
record("best_loss", float(getattr(state["best_loss"], "value", state["best_loss"])))
record("history", np.asarray(state["history"]).tolist())
train(model, optimizer, 3, "resumed")
