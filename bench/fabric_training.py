"""Tokens/s of a small transformer trained at 90% sparsity through the fabric vs masked dense.

Both runs start from the same weights and the same RigL masks and see the same batches; the
masked dense run is what training without the simulator does (sparsity hooks on a dense model),
the fabric run is the same model after ``simulator.compile``. Also prints the final losses, the
kernel decisions, the CSR rebuild times and the cost model's projected CS-2 step from the live
masks. Writes bench/results/fabric_training.json.

    python bench/fabric_training.py [--quick] [--steps N] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

import simulator  # noqa: E402
import sparsity  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fabric_training.json"


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_head: int, d_ff: int, n_layer: int,
                 seq_len: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.pos_embedding = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_ff) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx) + self.pos_embedding(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def batches(steps: int, batch: int, seq_len: int, vocab: int):
    """A fixed, learnable token stream: noisy arithmetic sequences (no download)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab
        noise = torch.rand(seq.shape, generator=gen) < 0.05
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=gen), seq)
        yield seq[:, :-1], seq[:, 1:]


class Run:
    """One model + RigL + AdamW; the masked dense and the fabric run are stepped alternately,
    so load from other processes hits both alike."""

    def __init__(self, fabric: bool, cfg: dict) -> None:
        torch.manual_seed(0)
        self.fabric = fabric
        self.model = TinyGPT(**cfg["model"])
        self.algorithm = sparsity.RigL(sparsity=0.9, update={"freq": cfg["update_freq"]},
                                       drop_fraction=0.3, seed=0)
        self.algorithm.apply(self.model)
        if fabric:
            simulator.compile(self.model, self.algorithm,
                              tokens=cfg["batch"] * cfg["model"]["seq_len"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.algorithm.apply(self.optimizer)
        self.losses: list[float] = []
        self.timed_s = 0.0

    def step(self, x: torch.Tensor, y: torch.Tensor, timed: bool) -> None:
        start = time.perf_counter()
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if timed:
            self.timed_s += time.perf_counter() - start
        self.losses.append(loss.item())

    def summary(self, cfg: dict, steps: int) -> dict:
        seq_len = cfg["model"]["seq_len"]
        tokens = steps * cfg["batch"] * seq_len
        result = {"tokens_per_s": tokens / self.timed_s, "step_ms": self.timed_s / steps * 1e3,
                  "first_loss": self.losses[0], "final_loss": self.losses[-1],
                  "losses": self.losses}
        if self.fabric:
            result["decisions"] = [
                {"name": d.name, "shape": d.shape, "density": d.density, "kernel": d.kernel,
                 "why": d.why, "rebuilds": d.rebuilds, "last_rebuild_ms": d.last_rebuild_ms}
                for d in simulator.decisions(self.model)]
            layers = simulator.layers_from_model(self.model, seq_tokens=seq_len)
            projection = simulator.project_step(layers, tokens=cfg["batch"] * seq_len,
                                                cluster=simulator.WaferScaleCluster(1))
            result["cs2_projection"] = projection.metrics()
        return result


def train_both(cfg: dict, steps: int, warmup: int) -> tuple[dict, dict]:
    dense, fabric = Run(False, cfg), Run(True, cfg)
    stream = batches(warmup + steps, cfg["batch"], cfg["model"]["seq_len"], cfg["model"]["vocab"])
    for step, (x, y) in enumerate(stream):
        for run in (dense, fabric) if step % 2 == 0 else (fabric, dense):
            run.step(x, y, timed=step >= warmup)
    return dense.summary(cfg, steps), fabric.summary(cfg, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (~20 s)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (8 if args.quick else 30)
    cfg = {"model": dict(vocab=256, d_model=512, n_head=8, d_ff=2048, n_layer=2, seq_len=128),
           "batch": 16, "update_freq": 10}
    warmup = 2
    dense, fabric = train_both(cfg, steps, warmup)
    ratio = fabric["tokens_per_s"] / dense["tokens_per_s"]
    print(f"model {cfg['model']}, batch {cfg['batch']}, 90% RigL sparsity, {steps} timed steps, "
          f"{torch.get_num_threads()} threads")
    print(f"masked dense: {dense['tokens_per_s']:9.0f} tokens/s ({dense['step_ms']:.1f} ms/step),"
          f" loss {dense['first_loss']:.3f} -> {dense['final_loss']:.3f}")
    print(f"fabric (CSR): {fabric['tokens_per_s']:9.0f} tokens/s ({fabric['step_ms']:.1f} ms/step),"
          f" loss {fabric['first_loss']:.3f} -> {fabric['final_loss']:.3f}")
    print(f"fabric / masked dense tokens/s: {ratio:.2f}x; max |loss difference| "
          f"{max(abs(a - b) for a, b in zip(dense['losses'], fabric['losses'])):.2e}")
    for d in fabric["decisions"]:
        print(f"  {d['name']:24s} {str(d['shape']):12s} density {d['density']:.3f} "
              f"{d['kernel']:5s} rebuilds {d['rebuilds']} ({d['last_rebuild_ms']:.2f} ms)")
    proj = fabric["cs2_projection"]
    print(f"projected CS-2 step from the live masks: {proj['perf/sim_step_ms']:.3f} ms, "
          f"speed-up vs dense {proj['perf/speedup_vs_dense']:.2f}x")
    if not all(math.isfinite(v) for v in (dense["final_loss"], fabric["final_loss"])):
        raise SystemExit("non-finite loss")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": cfg, "steps": steps,
                                    "threads": torch.get_num_threads(),
                                    "masked_dense": dense, "fabric": fabric,
                                    "tokens_per_s_ratio": ratio}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
