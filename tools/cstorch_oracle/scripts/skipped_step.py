"""GradScaler with an overflow at the third of eight steps, under SET (random regrowth every
step, from the global RNG), RigL and a Static model: masks, the sparsity step and the hook
calls after each step, the losses, whether the skipped step left weights and momentum as they
were, and where the global RNG stream stands at the end (the reference runs the skipped step, SET's draws included, and rolls it back).
``record`` is provided by the harness."""

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
cstorch.amp.init()  # the CSX backend calls this itself; off the system the GradScaler needs it

CASES = {
    "set": lambda: cstorch.sparse.SET(sparsity=0.6, drop_fraction=0.3),
    "set_every_2": lambda: cstorch.sparse.SET(sparsity=0.5, drop_fraction=0.4, update={"freq": 2}),
    "rigl": lambda: cstorch.sparse.RigL(sparsity=0.5, drop_fraction=0.3, update={"freq": 2}),
    "static": lambda: cstorch.sparse.Static(sparsity=0.7),
}

for case, make in CASES.items():
    torch.manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))
    sparsity = make()
    sparsity.register_target_sparsity_hook(lambda alg, name, level, case=case: record(f"{case}/target", [name, level]))
    sparsity.register_computed_sparsity_hook(lambda alg, name, level, case=case: record(f"{case}/actual", [name, level]))
    sparsity.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer.apply(sparsity)
    sparsity.initialize()
    # dynamic scaling held at 1.0: off a CS system the reference leaves the loss unscaled but
    # still divides the gradients by the scale, so only a scale of 1 gives it true gradients
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0, max_loss_scale=1.0)
    data = torch.Generator().manual_seed(13)
    for step in range(8):
        inputs, targets = torch.randn(6, 8, generator=data), torch.randn(6, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        if step == 2:
            loss = loss * float("inf")  # an overflow, as half precision gives: the step is skipped
            before = [t.clone() for p in model.parameters() for t in (p, optimizer.state[p]["momentum_buffer"])]
        else:
            record(f"{case}/loss", loss)
        cstorch.amp.optimizer_step(loss, optimizer, scaler)
        if step == 2:
            after = [t for p in model.parameters() for t in (p, optimizer.state[p]["momentum_buffer"])]
            record(f"{case}/weights_and_momentum_held", all(torch.equal(a, b) for a, b in zip(before, after)))
        record(f"{case}/masks", {n: b for n, b in model.named_buffers() if n.endswith("_mask")})
        record(f"{case}/sparsity_step", getattr(sparsity, "step", -1))
    record(f"{case}/skipped", scaler.get_num_skipped_steps())
    record(f"{case}/global_rng_after", torch.rand(4))
