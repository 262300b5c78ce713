"""Cost of training masked (80% RigL) instead of dense: one AdamW step of the same transformer.

Three copies of the project's model (the `small` preset, models/config.py: 8 layers, 6.3M parameters) start
from the same weights and see the same batches: dense, masked with RigL updating every 100 steps
(every timed step is an ordinary one), and masked with RigL updating on every step (every timed
step is an update step: dense-gradient capture, drop, growth, zeroing). They are stepped in
turn, in an order that rotates each step, so load from other processes hits all three alike;
warm-up steps are not timed and the medians are compared. The amortised ratio is a run that
updates every 100 steps: 99 ordinary steps and one update step per 100 dense steps.

The step is split into forward + backward and `optimizer.step()`, and the sparsity library's own
step hooks are timed on their own (hooks registered just before and after them on the same
optimizer), so the ratio's parts can be told apart. The gradient hooks (masking the gradients
when backward ends, and capturing the dense gradient before an update step) run inside
backward, so their cost is in the forward + backward row. After the last step the masked runs are
checked: weights, gradients and AdamW moments exactly 0 wherever the mask is False. Target:
ordinary and amortised ratios ≤ 1.05, and the ordinary step no slower than the fastest peer.

Peers, stepped in the same rotation on the same weights, batches and optimizer, masking the same
layers at the same sparsity with their own RigL (an update every 100 steps, so every timed step
is an ordinary one for them too), each when installed (``pip install --no-deps rigl-torch
sparsimony``):
  rigl-torch   RigLScheduler: a gradient hook per weight, weights re-masked after every step.
               It imports torchvision only to recognise ResNet blocks; where no torchvision
               loads with this torch (PyPI's 0.28 wheel needs its CUDA-built operators, 0.29
               needs torch 2.14), a stand-in module holding those two classes is registered.
  sparsimony   RigL on torch.ao's BaseSparsifier: a parametrization recomputes weight ⊙ mask
               on every forward and keeps a dense-gradient buffer.
With one thread (the default) a step's time is the calling thread's CPU time, which other
processes on a shared machine disturb far less than wall time. Writes
bench/results/masked_overhead.json.

AdamW is built as workers/ builds it, with its fused CPU kernel. ``--foreach`` times torch's
default (foreach) AdamW instead: it takes the square root of every second moment, and on some
CPUs the vectorised sqrt is several times slower on the exact zeros a masked run keeps there,
which is why the trainer uses the fused kernel.

    python bench/masked_overhead.py [--quick] [--steps N] [--threads 1] [--foreach]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

import sparsity  # noqa: E402
from models.config import preset_config  # noqa: E402
from models.transformer import build_model  # noqa: E402

from record import write_json  # noqa: E402  (bench/ is on sys.path as a script)

RESULTS = Path(__file__).resolve().parent / "results" / "masked_overhead.json"
PRESET, BATCH, SEQ_LEN = "small", 4, 128
SPARSITY, DROP_FRACTION, UPDATE_FREQ = 0.8, 0.3, 100
TARGET_RATIO = 1.05
PEERS = ("rigl-torch", "sparsimony")


def clock() -> float:
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


class Run:
    """One model and its AdamW, dense or masked by RigL updating every `update_freq` steps."""

    def __init__(self, name: str, update_freq: int | None, fused: bool) -> None:
        self.name = name
        self.model = build_model(preset_config(PRESET), seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=fused)
        self.algorithm = None
        self.peer_step = None  # a peer's own step logic (rigl-torch skips optimizer.step on updates)
        self.times_s: dict[str, list[float]] = {"step": [], "forward_backward": [],
                                                "optimizer_step": [], "sparsity_hooks": []}
        self._hooks_s = 0.0
        if update_freq is not None:
            self.algorithm = sparsity.RigL(sparsity=SPARSITY, drop_fraction=DROP_FRACTION,
                                           update={"freq": update_freq}, seed=0)
            self.model.apply(self.algorithm)
            # Hooks run in registration order: these bracket the ones the algorithm adds.
            self.optimizer.register_step_pre_hook(self._start_hooks)
            self.optimizer.register_step_post_hook(self._start_hooks)
            self.algorithm.apply(self.optimizer)
            self.optimizer.register_step_pre_hook(self._stop_hooks)
            self.optimizer.register_step_post_hook(self._stop_hooks)
        self.loss = float("nan")

    def _start_hooks(self, *_: object) -> None:
        self._hooks_started = clock()

    def _stop_hooks(self, *_: object) -> None:
        self._hooks_s += clock() - self._hooks_started

    def step(self, x: torch.Tensor, y: torch.Tensor, timed: bool) -> None:
        self._hooks_s = 0.0
        started = clock()
        _, loss = self.model(x, y)
        self.optimizer.zero_grad()
        loss.backward()
        backward_done = clock()
        if self.peer_step is not None:
            self.peer_step()
        else:
            self.optimizer.step()
        done = clock()
        if timed:
            for key, seconds in (("step", done - started), ("forward_backward", backward_done - started),
                                 ("optimizer_step", done - backward_done), ("sparsity_hooks", self._hooks_s)):
                self.times_s[key].append(seconds)
        self.loss = loss.item()

    def median_ms(self, part: str = "step") -> float:
        return statistics.median(self.times_s[part]) * 1e3

    def check_masked(self) -> None:
        """docs/design.md §2: weights, gradients and same-shaped optimizer state are 0 where masked."""
        for name, param, mask in self.algorithm.sparse_parameters():
            tensors = [param, param.grad, *(v for v in self.optimizer.state[param].values()
                                            if torch.is_tensor(v) and v.shape == param.shape)]
            if any(bool(t[~mask].ne(0).any()) for t in tensors):
                raise AssertionError(f"{self.name}: {name} has non-zeros where it is masked")


def sparse_linears(reference: Run, model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The layers of `model` named like the ones our RigL masks in `reference`."""
    names = {name.removesuffix(".weight") for name, _, _ in reference.algorithm.sparse_parameters()}
    return [(name, module) for name, module in model.named_modules() if name in names]


def rigl_torch_run(reference: Run, fused: bool) -> Run:
    if importlib.util.find_spec("torchvision") is None or not _torchvision_loads():
        stand_in = types.ModuleType("torchvision")
        stand_in.models = types.SimpleNamespace(resnet=types.SimpleNamespace(
            Bottleneck=type("Bottleneck", (nn.Module,), {}),
            BasicBlock=type("BasicBlock", (nn.Module,), {})))
        sys.modules["torchvision"] = stand_in
    from rigl_torch.RigL import RigLScheduler

    run = Run("rigl-torch", None, fused)
    # rigl-torch keeps its first layer dense under 'uniform': a 1x1 placeholder takes that
    # place, so exactly our masked layers are sparse, at our sparsity.
    layers = nn.ModuleList([nn.Linear(1, 1)] + [m for _, m in sparse_linears(reference, run.model)])
    scheduler = RigLScheduler(layers, run.optimizer, dense_allocation=1 - SPARSITY,
                              T_end=10**9, delta=UPDATE_FREQ, alpha=DROP_FRACTION,
                              sparsity_distribution="uniform", ignore_linear_layers=False)
    run.peer_step = lambda: scheduler() and run.optimizer.step()
    return run


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load means: use the stand-in
        return False
    return True


def sparsimony_run(reference: Run, fused: bool) -> Run:
    from sparsimony.distributions.base import UniformDistribution
    from sparsimony.dst.rigl import RigL as SparsimonyRigL
    from sparsimony.schedulers.base import ConstantScheduler

    run = Run("sparsimony", None, fused)
    sparsifier = SparsimonyRigL(ConstantScheduler(DROP_FRACTION, t_end=10**9, delta_t=UPDATE_FREQ),
                                UniformDistribution(), run.optimizer, sparsity=SPARSITY)
    sparsifier.prepare(run.model, [{"tensor_fqn": f"{name}.weight"}
                                   for name, _ in sparse_linears(reference, run.model)])

    def step() -> None:
        run.optimizer.step()
        sparsifier.step()
    run.peer_step = step
    return run


def check_peer_sparsity(peer: Run, reference: Run) -> None:
    """A peer must have trained the same layers at our sparsity, or its timing means nothing."""
    weights = [module.weight for _, module in sparse_linears(reference, peer.model)]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    if abs(zeros - SPARSITY) > 0.01:
        raise AssertionError(f"peer {peer.name}: {zeros:.3f} of the masked layers' weights are 0, "
                             f"expected {SPARSITY}")


def peer_runs(reference: Run, fused: bool) -> tuple[list[Run], dict[str, str]]:
    """The peers that are installed, and why the others are missing."""
    builders = {"rigl-torch": (rigl_torch_run, "rigl_torch"),
                "sparsimony": (sparsimony_run, "sparsimony")}
    runs, missing = [], {}
    for name in PEERS:
        build, module = builders[name]
        if importlib.util.find_spec(module) is None:
            missing[name] = "not installed (pip install --no-deps " + name + ")"
            continue
        runs.append(build(reference, fused))
    return runs, missing


def row(step: str, dense_ms: float, masked_ms: float, target: float | None = None) -> dict:
    """A table row; ``ratio`` is masked / dense (for the hooks: their share of the dense step)."""
    return {"step": step, "dense_ms": dense_ms, "masked_ms": masked_ms,
            "ratio": masked_ms / dense_ms, "target": target}


def batches(count: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (BATCH, SEQ_LEN + 1), generator=generator) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 timed steps instead of 40")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-peers", action="store_true", help="time our runs only")
    parser.add_argument("--foreach", action="store_true",
                        help="torch's default AdamW instead of the fused kernel the trainer uses")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_at_start = os.getloadavg()  # a shared machine: the run's neighbours, recorded
    torch.set_num_threads(args.threads)
    steps = args.steps or (8 if args.quick else 40)
    warmup = 2 if args.quick else 3
    fused = not args.foreach
    runs = [Run("dense", None, fused), Run("masked", UPDATE_FREQ, fused),
            Run("masked, updating", 1, fused)]
    dense, ordinary, updating = runs
    peers, missing_peers = ([], {}) if args.no_peers else peer_runs(ordinary, fused)
    runs += peers
    for index, (x, y) in enumerate(batches(warmup + steps, dense.model.built.vocab_size)):
        for run in runs[index % len(runs):] + runs[:index % len(runs)]:
            run.step(x, y, timed=index >= warmup)
    for run in (ordinary, updating):
        run.check_masked()
    for peer in peers:
        check_peer_sparsity(peer, ordinary)

    dense_ms, ordinary_ms, update_ms = dense.median_ms(), ordinary.median_ms(), updating.median_ms()
    amortised_ms = ((UPDATE_FREQ - 1) * ordinary_ms + update_ms) / UPDATE_FREQ
    rows = [
        row("ordinary step", dense_ms, ordinary_ms, TARGET_RATIO),
        row("  forward + backward", dense.median_ms("forward_backward"),
            ordinary.median_ms("forward_backward")),
        row("  optimizer.step() with hooks", dense.median_ms("optimizer_step"),
            ordinary.median_ms("optimizer_step")),
        row("  sparsity hooks / dense step", dense_ms, ordinary.median_ms("sparsity_hooks")),
        row("RigL update step", dense_ms, update_ms),
        row("  sparsity hooks / dense step", dense_ms, updating.median_ms("sparsity_hooks")),
        row(f"amortised (update every {UPDATE_FREQ})", dense_ms, amortised_ms, TARGET_RATIO),
        *[row(f"peer {peer.name}, ordinary step", dense_ms, peer.median_ms()) for peer in peers],
    ]
    fastest_peer = min(peers, key=Run.median_ms, default=None)
    params = dense.model.num_parameters()
    sparse_params = sum(p.numel() for _, p, _ in ordinary.algorithm.sparse_parameters())
    print(f"model {PRESET} ({params / 1e6:.1f}M parameters, {sparse_params / 1e6:.1f}M masked), "
          f"batch {BATCH} x {SEQ_LEN} tokens, AdamW{' (fused)' if fused else ''}, RigL {SPARSITY:.0%}, "
          f"{torch.get_num_threads()} thread(s); median of {steps} steps after {warmup} warm-up")
    print(f"  {'':32s} {'dense ms':>9s} {'masked ms':>10s} {'ratio':>7s}")
    for r in rows:
        verdict = "" if r["target"] is None else \
            f"  (target <= {r['target']}: {'ok' if r['ratio'] <= r['target'] else 'MISS'})"
        print(f"  {r['step']:32s} {r['dense_ms']:9.1f} {r['masked_ms']:10.1f} {r['ratio']:7.3f}{verdict}")
    print(f"  final losses: dense {dense.loss:.3f}, masked {ordinary.loss:.3f}, "
          f"masked updating {updating.loss:.3f}; masks verified")

    if fastest_peer is not None:
        print(f"  ours / fastest peer ({fastest_peer.name}), ordinary step: "
              f"{ordinary_ms / fastest_peer.median_ms():.3f} (target <= 1: "
              f"{'ok' if ordinary_ms <= fastest_peer.median_ms() else 'MISS'})")
    for name, why in missing_peers.items():
        print(f"  peer {name}: {why}")
    meets = all(r["ratio"] <= r["target"] for r in rows if r["target"] is not None) and (
        fastest_peer is None or ordinary_ms <= fastest_peer.median_ms())
    write_json(args.out, {
        "config": {"preset": PRESET, "parameters": params, "masked_parameters": sparse_params,
                   "batch": BATCH, "seq_len": SEQ_LEN, "sparsity": SPARSITY,
                   "drop_fraction": DROP_FRACTION, "update_freq": UPDATE_FREQ,
                   "optimizer": "AdamW(fused=True)" if fused else "AdamW"},
        "quick": args.quick, "timed_steps": steps, "warmup_steps": warmup,
        "dense_step_ms": dense_ms, "ordinary_step_ratio": rows[0]["ratio"],
        "hooks_share_of_dense_step_ratio": rows[3]["ratio"], "update_step_ratio": rows[4]["ratio"],
        "amortised_ratio": rows[6]["ratio"],
        "clock": "thread CPU time" if torch.get_num_threads() == 1 else "wall",
        "peers": {peer.name: {"ordinary_step_ms": peer.median_ms(),
                              "ratio_to_dense": peer.median_ms() / dense_ms} for peer in peers},
        "missing_peers": missing_peers,
        "ours_to_fastest_peer_ratio": (ordinary_ms / fastest_peer.median_ms()
                                       if fastest_peer is not None else None),
        "meets_target": meets, "rows": rows}, load_at_start=load_at_start,
        threads=torch.get_num_threads())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
