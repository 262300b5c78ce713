"""Checkpoint: RigL + AdamW for 20 steps; saving at 10 and resuming in a fresh process gives
bit-identical masks and weights at step 20."""

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

SCRIPT = textwrap.dedent(
    """
    import sys, torch, sparsity
    sys.path.insert(0, {helpers!r})
    from sparsity_helpers import TinyNet

    mode, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = TinyNet()
    alg = sparsity.RigL(sparsity=0.8, update={{"freq": 3, "stop": 18}},
                        drop_fraction={{"type": "cosine", "init": 0.3, "half_period": 18}}, seed=11)
    model.apply(alg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alg.apply(opt)
    start, stop = {{"full": (0, 20), "first": (0, 10), "resume": (10, 20)}}[mode]
    if mode == "resume":
        ckpt = torch.load(path + ".ckpt")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        alg.load_state_dict(ckpt["sparsity"])
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(1000 + step)  # data position = step
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 6, generator=gen)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        alg.mask_gradients()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    out = {{"model": model.state_dict(), "optimizer": opt.state_dict(), "sparsity": alg.state_dict()}}
    torch.save(out, path + (".ckpt" if mode == "first" else "." + mode))
    """
)


def run(mode: str, path: Path) -> None:
    code = SCRIPT.format(helpers=str(Path(__file__).parent))
    subprocess.run([sys.executable, "-c", code, mode, str(path)], check=True, timeout=120)


def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    base = tmp_path / "run"
    run("full", base)
    run("first", base)
    run("resume", base)
    full = torch.load(str(base) + ".full")
    resumed = torch.load(str(base) + ".resume")
    assert full["sparsity"]["step"] == resumed["sparsity"]["step"] == 20
    for key, value in full["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    assert any(key.endswith("_mask") for key in full["model"])
    first = torch.load(str(base) + ".ckpt")
    assert any(
        not torch.equal(first["model"][k], full["model"][k]) for k in full["model"] if k.endswith("_mask")
    ), "masks must change after step 10 for the test to mean something"
