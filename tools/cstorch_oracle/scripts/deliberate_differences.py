"""Where ``sparsity.cstorch`` differs from the reference on purpose (docs/cstorch.md's
table), recorded so the suite checks each difference is exactly the documented one: a
step-varying ``drop_fraction``, a Cycling schedule's state across ``load_state_dict``, a
checkpoint mask loaded under another configured level, masks loaded through a submodule's
``load_state_dict``, ``amp.init()``'s float16 matmuls on the CPU (it patches the process, so
after the others), the learning rate of the step after a skipped one, a scheduler stepped after
a scaled step, the state kept by the optimizers PyTorch computes, and a Muon step. ``record``
is provided by the harness."""

import warnings

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
warnings.simplefilter("ignore")


def model_of(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 40), torch.nn.ReLU(), torch.nn.Linear(40, 4))


def train(model, optimizer, steps):
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(8, 10, generator=generator)),
                                     torch.randn(8, 4, generator=generator)).backward()
        optimizer.step()


# 1. drop_fraction on a cosine: how many weights each update swaps out
model = model_of(1)
sparsity = cstorch.sparse.SET(sparsity=0.5, drop_fraction={"type": "cosine", "init": 0.5, "half_period": 4},
                              update={"freq": 1})
sparsity.apply(model)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
optimizer.apply(sparsity)
sparsity.initialize()
for step in range(4):
    before = model[0].weight_mask.clone()
    train(model, optimizer, [step])
    record("swapped_out", int((before & ~model[0].weight_mask).sum()))

# 2. a Cycling schedule's index across load_state_dict
model = model_of(2)
sparsity = cstorch.sparse.GMP(sparsity=[0.2, 0.4, 0.6, 0.8], update={"freq": 2})
sparsity.apply(model)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
optimizer.apply(sparsity)
sparsity.initialize()
train(model, optimizer, range(3))
saved = sparsity.state_dict()
record("cycling_saved", saved)
fresh = cstorch.sparse.GMP(sparsity=[0.2, 0.4, 0.6, 0.8], update={"freq": 2})
fresh.apply(model_of(2))
fresh.load_state_dict(saved)
record("cycling_loaded", fresh.state_dict())

# 3. a checkpoint mask at 50% loaded where the config now says 75%
model = model_of(3)
sparsity = cstorch.sparse.Static(sparsity=0.5)
sparsity.apply(model)
sparsity.initialize()
checkpoint = model.state_dict()
resumed_model = model_of(4)
resumed = cstorch.sparse.Static(sparsity=0.75)
resumed.apply(resumed_model)
resumed_model.load_state_dict(checkpoint)
resumed.initialize()
record("restart_kept", int(resumed_model[0].weight_mask.sum()))

# 4. a state dict loaded into a submodule of the sparsified model, then initialize()
source = model_of(5)
sparsity = cstorch.sparse.Static(sparsity=0.5)
sparsity.apply(source)
sparsity.initialize()
first_layer = {k: v.clone() for k, v in source[0].state_dict().items()}
target = model_of(6)
loading = cstorch.sparse.Static(sparsity=0.5)
loading.apply(target)
target[0].load_state_dict(first_layer)
loading.initialize()
record("submodule_masks_kept", bool(torch.equal(target[0].weight_mask, first_layer["weight_mask"])))

# 5. amp.init(): the dtype a float32 linear layer computes in afterwards
cstorch.amp.init()
layer = model_of(7)[0]
record("linear_dtype_after_amp_init", str(layer(torch.randn(8, 10)).dtype))

# 6. the learning rate each step uses around a step the GradScaler skips (the second of five),
# the scheduler stepped from an optimizer step hook: the one place the reference (off a CS
# system) lets a scheduler step once a dynamic GradScaler holds the optimizer (7. below)
model = model_of(8)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
scheduler = cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.1, end_learning_rate=0.0,
                                                total_iters=10)
scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0, max_loss_scale=1.0)
optimizer.register_step_post_hook(lambda opt, args, kwargs: scheduler.step())
for step in range(5):
    record("lr_used", float(optimizer.param_groups[0]["lr"]))
    generator = torch.Generator().manual_seed(step)
    loss = torch.nn.functional.mse_loss(model(torch.randn(8, 10, generator=generator)),
                                        torch.randn(8, 4, generator=generator))
    cstorch.amp.optimizer_step(loss * float("inf") if step == 1 else loss, optimizer, scaler)
    record("last_epoch", int(scheduler.last_epoch))

# 7. scheduler.step() after the scaled step, as a training loop writes it
model = model_of(9)
optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
scheduler = cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.1, end_learning_rate=0.0,
                                                total_iters=10)
scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0, max_loss_scale=1.0)
cstorch.amp.optimizer_step(model(torch.randn(8, 10)).square().mean(), optimizer, scaler)
try:
    scheduler.step()
    record("scheduler_step_after_scaled_step", "ok")
except RuntimeError as error:
    record("scheduler_step_after_scaled_step", type(error).__name__)

# 8. the state Adadelta, RMSprop and Rprop keep (PyTorch's arithmetic here) after a step
for name in ("Adadelta", "RMSprop", "Rprop"):
    layer = model_of(10)[0]
    optimizer = getattr(cstorch.optim, name)(layer.parameters())
    layer(torch.randn(8, 10)).square().mean().backward()
    optimizer.step()
    record(f"state_keys/{name}", sorted(optimizer.state[layer.weight]))

# 9. a Muon step (on matrices, as Muon is meant for)
layer = torch.nn.Linear(10, 6, bias=False)
optimizer = cstorch.optim.Muon(layer.parameters())
layer(torch.randn(8, 10)).square().mean().backward()
try:
    optimizer.step()
    record("muon_step", "ok")
except TypeError as error:
    record("muon_step", type(error).__name__)
