"""A research script: RigL with output-balanced groups and an Adam optimizer, cstorch's
GradScaler and ``amp.optimizer_step`` with gradient clipping, a checkpoint after 6 steps and a
resume into a freshly built model, optimizer and algorithm (plain ``load_state_dict`` calls),
compared with the run that never stopped. ``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
cstorch.amp.init()  # the CSX backend calls this itself; off the system the GradScaler needs it


algorithms = {}


def build():
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 6))
    sparsity = cstorch.sparse.RigL(sparsity=0.75, drop_fraction=0.3, balance_out_groups=4,
                                   update={"freq": 2, "stop": 11})
    for bias in (model[0].bias, model[2].bias, model[4].bias):
        bias.requires_dense = True
    sparsity.apply(model)
    optimizer = cstorch.optim.Adam(model.parameters(), lr=0.01)
    optimizer.apply(sparsity)
    algorithms[optimizer] = sparsity
    # dynamic scaling held at 1.0: off a CS system the reference leaves the loss unscaled but
    # still divides the gradients by the scale, so only a scale of 1 gives it true gradients
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0, max_loss_scale=1.0)
    return model, sparsity, optimizer, scaler


overflow_batch = None


def batches(start, stop):
    global overflow_batch
    for step in range(start, stop):
        generator = torch.Generator().manual_seed(100 + step)
        inputs = torch.randn(16, 24, generator=generator)
        overflow_batch = inputs if step == 3 else overflow_batch
        yield inputs, torch.randn(16, 6, generator=generator)


def sparsity_of(optimizer):
    return algorithms[optimizer]


def train(model, optimizer, scaler, start, stop, label):
    for inputs, targets in batches(start, stop):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        if start <= 3 < stop and inputs is overflow_batch:
            loss = loss * float("inf")  # an overflow, as half precision gives: the step is skipped
        cstorch.amp.optimizer_step(loss, optimizer, scaler, max_gradient_norm=0.5)
        record(f"{label}_loss", loss)
        record(f"{label}_sparsity_step", sparsity_of(optimizer).step)


torch.manual_seed(5)
model, sparsity, optimizer, scaler = build()
sparsity.initialize()
train(model, optimizer, scaler, 0, 6, "first")
cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sparsity": sparsity.state_dict(),
              "grad_scaler": scaler.state_dict()}, "resume.mdl")
train(model, optimizer, scaler, 6, 12, "uninterrupted")
record("uninterrupted_masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
record("uninterrupted_step", sparsity.step)
record("skipped_steps", scaler.get_num_skipped_steps())

torch.manual_seed(6)  # a new process: other random weights and masks until the checkpoint loads
model, sparsity, optimizer, scaler = build()
state = cstorch.load("resume.mdl")
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
sparsity.load_state_dict(state["sparsity"])
scaler.load_state_dict(state["grad_scaler"])
sparsity.initialize()  # keeps the loaded masks
record("resumed_step", sparsity.step)
train(model, optimizer, scaler, 6, 12, "resumed")
record("resumed_masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
record("row_counts", [model[0].weight_mask.reshape(4, -1).sum(1), model[2].weight_mask.reshape(4, -1).sum(1)])
