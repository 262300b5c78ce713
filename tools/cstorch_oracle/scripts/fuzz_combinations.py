"""Random combinations, drawn from a fixed seed, of what a cstorch sparsity script can vary:
the algorithm (Static, GMP, SET, RigL, a user DynamicSparsityAlgorithm), its sparsity schedule
(a number, every built-in type, an explicit Lambda, a user stateless and two user stateful
schedules), the update cadence (every step, freq/start/stop, a step list, a user
UpdateSchedule), how parameters are chosen (the algorithm on the whole model, a glob, a list
of globs, ``configure``'s default filter, a callable through ``Group.add``, two groups), the
layer count and widths, the optimizer and gradient accumulation over micro-batches. Each
combination trains a tiny model for a few steps and records its description, a fingerprint
of every mask and the kept counts after each step, the losses, the target-sparsity hook
calls and the final state dict. ``record`` is provided by the harness."""

import hashlib
import random

import torch

import cerebras.pytorch as cstorch

backend = cstorch.backend("CPU")
COMBINATIONS = 240
STEPS = 6


class Cubic(cstorch.sparse.utils.HyperParameterSchedule):
    """Stateless: Zhu & Gupta's cubic ramp from ``init`` to ``final`` over ``steps``."""

    def __init__(self, init, final, steps):
        super().__init__()
        self.init, self.final, self.steps = init, final, steps

    def compute(self, step):
        progress = torch.clamp(step.float() / self.steps, max=1.0)
        return self.final + (self.init - self.final) * (1 - progress) ** 3


class Staircase(cstorch.sparse.utils.HyperParameterSchedule):
    """Stateful: ``start`` raised by ``rise`` at every update step, written as Cycling is."""

    def __init__(self, start, rise):
        super().__init__()
        self.start, self.rise = start, rise
        self.climbed = torch.tensor(0, dtype=torch.int64)

    def compute(self, step):
        return torch.clamp(self.start + self.rise * self.climbed.float(), max=0.95)

    def update(self, is_update_step):
        self.climbed = self.climbed + is_update_step.long()

    def state_dict(self):
        return {"climbed": self.climbed}


class CountedCycling(cstorch.sparse.utils.Cycling):
    """Stateful through ``super().update()``: Cycling that counts its updates."""

    def __init__(self, values):
        super().__init__(values)
        self.calls = torch.tensor(0, dtype=torch.int64)

    def update(self, is_update_step):
        self.calls = self.calls + 1
        super().update(is_update_step)

    def state_dict(self):
        return {**super().state_dict(), "calls": self.calls}


class Offbeat(cstorch.sparse.utils.UpdateSchedule):
    """A user cadence: steps ``phase``, ``phase + period``, ..."""

    def __init__(self, period, phase):
        self.period, self.phase = period, phase

    def is_update_step(self, step):
        return step % self.period == self.phase


class MagnitudeShuffle(cstorch.sparse.DynamicSparsityAlgorithm):
    """A user algorithm: prune by magnitude to the level, then swap a quarter at random."""

    @torch.no_grad()
    def update_mask(self, p, mask, sparsity):
        pruned = cstorch.sparse.utils.make_mask_topk_sparsity(p.abs() * mask, sparsity)
        kept, n_kept = cstorch.sparse.utils.make_mask_drop_minimum(p.abs(), pruned, 0.25)
        return cstorch.sparse.utils.make_mask_grow_maximum(torch.rand_like(p), kept, sparsity, n_kept)


def quarter_and_rise(step):
    return 0.25 + 0.05 * step.float()


def draw(rng, index):
    """One combination as plain data, and what builds its algorithm."""
    algorithm = rng.choice(["static", "gmp", "set", "rigl", "magnitudeshuffle"])
    choosing = rng.choice(["whole_model", "glob", "glob_list", "default_filter", "callable", "two_groups"])
    configured = choosing in ("glob", "glob_list", "default_filter", "two_groups")
    level = round(rng.uniform(0.1, 0.85), 3)
    kinds = ["constant", "linear", "exp", "power", "cosine", "cycling", "cubic", "staircase"]
    if not configured:  # instances cannot go through configure's deep copy of its dict
        kinds += ["lambda", "counted_cycling"]
    if algorithm == "gmp":
        kinds.remove("constant")  # GMP refuses a constant schedule
    schedule = "constant" if algorithm == "static" else rng.choice(kinds)
    cadences = ["every_step", "freq", "freq_start_stop", "steps"] + ([] if configured else ["user"])
    cadence = None if algorithm == "static" else rng.choice(cadences)
    spec = {
        "index": index, "algorithm": algorithm, "choosing": choosing, "schedule": schedule, "cadence": cadence,
        "level": level, "layers": [rng.randint(3, 10) for _ in range(rng.randint(1, 4))],
        "inputs": rng.randint(3, 10), "micro_batches": rng.randint(1, 3),
        "optimizer": rng.choice(["sgd", "sgd_momentum", "adam", "adamw"]),
        "drop_fraction": round(rng.uniform(0.1, 0.6), 3),
        "init_method": rng.choice(["random", "topk"]),
        "schedule_options": {
            "linear": {"type": "linear", "init": level, "slope": 0.05},
            "exp": {"type": "exp", "init": 0.05, "gamma": -0.4, "final": level},
            "power": {"type": "power", "init": level, "beta": 0.9},
            "cosine": {"type": "cosine", "init": level, "half_period": rng.randint(2, 5),
                       "minimum": round(level / 3, 3)},
            "cycling": [level, round(level / 2, 3), round(min(level * 1.2, 0.9), 3)],
            "cubic": {"type": "cubic", "init": 0.05, "final": level, "steps": rng.randint(2, 6)},
            "staircase": {"type": "staircase", "start": round(level / 2, 3), "rise": 0.07},
        }.get(schedule, level),
        "update_options": {
            "every_step": None, "freq": {"freq": rng.randint(1, 3)},
            "freq_start_stop": {"freq": rng.randint(1, 2), "start": rng.randint(0, 2), "stop": rng.randint(3, 6)},
            "steps": {"steps": sorted(rng.sample(range(STEPS + 1), 3))},
            "user": {"period": rng.randint(2, 3), "phase": rng.randint(0, 1)},
        }.get(cadence),
    }
    return spec


def sparsity_argument(spec):
    """The schedule as the algorithm's ``sparsity`` (config data, or an instance)."""
    options = spec["schedule_options"]
    if spec["schedule"] == "lambda":
        return cstorch.sparse.utils.Lambda(quarter_and_rise)
    if spec["schedule"] == "counted_cycling":
        return CountedCycling([spec["level"], round(spec["level"] / 2, 3)])
    if spec["schedule"] == "cubic" and spec["choosing"] in ("whole_model", "callable"):
        return Cubic(**{k: v for k, v in options.items() if k != "type"})
    if spec["schedule"] == "staircase" and spec["choosing"] in ("whole_model", "callable"):
        return Staircase(**{k: v for k, v in options.items() if k != "type"})
    return options


def algorithm_options(spec):
    options = {"sparsity": sparsity_argument(spec), "init_method": spec["init_method"]}
    if spec["algorithm"] != "static":
        options["update"] = (Offbeat(**spec["update_options"]) if spec["cadence"] == "user"
                             else spec["update_options"])
    if spec["algorithm"] in ("set", "rigl"):
        options["drop_fraction"] = spec["drop_fraction"]
    return options


def build(spec):
    options = algorithm_options(spec)
    if spec["choosing"] in ("whole_model", "callable"):
        classes = {"static": cstorch.sparse.Static, "gmp": cstorch.sparse.GMP, "set": cstorch.sparse.SET,
                   "rigl": cstorch.sparse.RigL, "magnitudeshuffle": MagnitudeShuffle}
        algorithm = classes[spec["algorithm"]](**options)
        if spec["choosing"] == "whole_model":
            return algorithm
        group = cstorch.sparse.Group()
        group.add(lambda name, param: name.startswith("0.") or name.endswith("bias"), algorithm)
        return group
    config = {"algorithm": spec["algorithm"], **options}
    if spec["choosing"] == "glob":
        return cstorch.sparse.configure({**config, "param_filter": "*.weight"})
    if spec["choosing"] == "glob_list":
        return cstorch.sparse.configure({**config, "param_filter": ["0.*", "*2.weight"]})
    if spec["choosing"] == "default_filter":
        return cstorch.sparse.configure(config)
    return cstorch.sparse.configure([{**config, "param_filter": "0.weight"},
                                     {"algorithm": "static", "sparsity": 0.5, "param_filter": "*.weight"}])


def make_model(spec):
    layers, width = [], spec["inputs"]
    for out in spec["layers"]:
        layers += [torch.nn.Linear(width, out), torch.nn.Tanh()]
        width = out
    return torch.nn.Sequential(*layers[:-1])


def make_optimizer(spec, params):
    return {"sgd": lambda: cstorch.optim.SGD(params, lr=0.1),
            "sgd_momentum": lambda: cstorch.optim.SGD(params, lr=0.05, momentum=0.9),
            "adam": lambda: cstorch.optim.Adam(params, lr=0.01),
            "adamw": lambda: cstorch.optim.AdamW(params, lr=0.01, weight_decay=0.1)}[spec["optimizer"]]()


def masks_seen(model):
    """A fingerprint of every mask (names and bits) and each mask's kept count."""
    masks = sorted((name, buffer) for name, buffer in model.named_buffers() if name.endswith("_mask"))
    digest = hashlib.sha256()
    for name, mask in masks:
        digest.update(name.encode())
        digest.update(bytes(mask.flatten().to(torch.uint8).tolist()))
    return {"fingerprint": digest.hexdigest()[:16], "kept": [int(mask.sum()) for _, mask in masks]}


rng = random.Random(36)
for index in range(COMBINATIONS):
    spec = draw(rng, index)
    key = f"{index:03d}"
    record(f"{key}/spec", spec)
    torch.manual_seed(1000 + index)
    model = make_model(spec)
    sparsity = build(spec)
    sparsity.register_target_sparsity_hook(lambda alg, name, level, key=key: record(f"{key}/target", [name, level]))
    sparsity.apply(model)
    optimizer = make_optimizer(spec, model.parameters())
    optimizer.apply(sparsity)
    sparsity.initialize()
    record(f"{key}/masks", masks_seen(model))
    data = torch.Generator().manual_seed(index)
    for step in range(STEPS):
        optimizer.zero_grad()
        for _ in range(spec["micro_batches"]):
            inputs = torch.randn(4, spec["inputs"], generator=data)
            targets = torch.randn(4, spec["layers"][-1], generator=data)
            loss = torch.nn.functional.mse_loss(model(inputs), targets) / spec["micro_batches"]
            loss.backward()
            record(f"{key}/loss", loss)
        optimizer.step()
        record(f"{key}/masks", masks_seen(model))
    record(f"{key}/state_dict", sparsity.state_dict())
