"""A ModelZoo-style run loop: backend, model built under ``backend.device``, compile, a
``sparsity`` section configured into groups, a cstorch optimizer and a SequentialLR (linear
warm-up then cosine decay), a traced training step, ``DataLoader`` + ``DataExecutor``, a step
closure that logs and a checkpoint closure that saves. ``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

params = {
    "sparsity": [
        {"algorithm": "static", "sparsity": 0.5, "init_method": "topk", "param_filter": "encoder.0.weight"},
        {"algorithm": "gmp", "sparsity": {"type": "linear", "init": 0.3, "slope": 0.05},
         "update": {"freq": 3}, "param_filter": "encoder.2.weight"},
        {"algorithm": "set", "sparsity": 0.7, "drop_fraction": 0.2, "update": {"freq": 2, "start": 2},
         "param_filter": ["head.weight"]},
    ],
    "optimizer": {"lr": 0.02, "weight_decay": 0.01},
    "runconfig": {"max_steps": 12, "checkpoint_steps": 5},
}


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.GELU(), torch.nn.Linear(48, 48),
                                           torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(48)
        self.head = torch.nn.Linear(48, 5)

    def forward(self, inputs):
        return self.head(self.norm(self.encoder(inputs)))


def input_fn(batch_size):
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(64, 20, generator=generator)
    labels = torch.randint(0, 5, (64,), generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)


backend = cstorch.backend("CPU")
torch.manual_seed(11)
with backend.device:
    model = Classifier()
compiled_model = cstorch.compile(model, backend)

sparsity = cstorch.sparse.configure(params["sparsity"])
model.apply(sparsity)
sparsity.register_target_sparsity_hook(lambda alg, name, level: record("target", [name, level]))
sparsity.register_computed_sparsity_hook(lambda alg, name, level: record("actual", [name, level]))

optimizer = cstorch.optim.AdamW(model.parameters(), **params["optimizer"])
optimizer.apply(sparsity)
lr_scheduler = cstorch.optim.lr_scheduler.SequentialLR(
    optimizer,
    schedulers=[
        cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.002, end_learning_rate=0.02,
                                            total_iters=4),
        cstorch.optim.lr_scheduler.CosineDecayLR(optimizer, initial_learning_rate=0.02, end_learning_rate=0.001,
                                                 total_iters=8),
    ],
    milestones=[4],
)
loss_fn = torch.nn.CrossEntropyLoss()


@cstorch.trace
def training_step(inputs, labels):
    loss = loss_fn(compiled_model(inputs), labels)
    loss.backward()
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()
    return loss


@cstorch.step_closure
def post_training_step(loss):
    record("loss", loss)
    record("lr", optimizer.param_groups[0]["lr"])


@cstorch.checkpoint_closure
def save_checkpoint(step):
    cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "sparsity": sparsity.state_dict()}, f"checkpoint_{step}.mdl")
    state = cstorch.load(f"checkpoint_{step}.mdl")
    record("checkpoint", {"step": step, "masks": {k: v for k, v in state["model"].items() if k.endswith("_mask")},
                          "sparsity": state["sparsity"],
                          "model_keys": sorted(state["model"])})


dataloader = cstorch.utils.data.DataLoader(input_fn, batch_size=8)
executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=params["runconfig"]["max_steps"],
                                           checkpoint_steps=params["runconfig"]["checkpoint_steps"])
for step, (inputs, labels) in enumerate(executor, start=1):
    loss = training_step(inputs, labels)
    post_training_step(loss)
    save_checkpoint(step)

record("masks", {name: buffer for name, buffer in model.named_buffers() if name.endswith("_mask")})
