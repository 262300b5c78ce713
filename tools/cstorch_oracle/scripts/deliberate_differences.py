"""Where ``sparsity.cstorch`` differs from the reference on purpose (docs/cstorch.md's
table), recorded so the suite checks each difference is exactly the documented one: a
step-varying ``drop_fraction``, a Cycling schedule's state across ``load_state_dict``, a
checkpoint mask loaded under another configured level, masks loaded through a submodule's
``load_state_dict``, and ``amp.init()``'s float16 matmuls on the CPU (last: it patches the
process). ``record`` is provided by the harness."""

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
