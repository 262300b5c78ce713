"""Why does RigL trail Static in the reference study? One controlled experiment per suspect.

Every row trains the reference study's model and data (`tiny` Llama, byte tokenizer,
`builtin:shakespeare`, 16 x 128 tokens per step, AdamW 3e-3 warmup-cosine, weight decay 0.1,
clip 1.0, 80% sparsity) with the same small loop below, so rows differ only in what the row
names: the sparsity section (algorithm, update period, drop fraction, distribution, grow_init),
what AdamW holds for a regrown weight, model size and steps. The loop is the study's
(`training/loop.py`) without its CSR kernels, checkpoints and tracking: the same update up
to float rounding, about twice as fast on one thread.

Which sparsity code runs is chosen per invocation (`--sparsity-root`, a directory holding the
`sparsity` package), so rows on the committed code (`head`) and on a changed one (`new`) share
everything else. Results append to a JSON-lines file as each run ends; `render` turns them
into research/results/rigl_cause.json and research/results/rigl_cause.md.

    python research/rigl_cause.py run --code head --rows static,set,rigl --seeds 0,1,2
    python research/rigl_cause.py run --code new --sparsity-root . --rows rigl_keep --seeds 0,1,2
    python research/rigl_cause.py render
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "research" / "results"
RAW = RESULTS / "rigl_cause.jsonl"

SPARSITY = 0.8
BATCH, SEQ_LEN, EVAL_BATCHES = 16, 128, 20
PEAK_LR, MIN_LR, WARMUP, WEIGHT_DECAY, CLIP = 3e-3, 3e-4, 50, 0.1, 1.0

# The study's cadence (service/studies.py): 10 updates over the first 75% of training,
# drop fraction cosine-decayed from 0.3 (Evci et al. 2020).
STUDY = {"update_every": 75, "stop_fraction": 0.75, "drop": 0.3}

# row name -> (description, settings). Settings: algorithm, code ("head" = committed sparsity
# package, "new" = the changed one), update_every, drop, distribution, grow_init (new code
# only), adam ("zero": regrown weights start with zero moments as the library leaves them;
# "v_mean": their second moment starts at the layer's mean over kept weights), preset, steps.
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("dense", {"algorithm": "dense"}),
    "static": ("Static 80%", {"algorithm": "static"}),
    "set": ("SET, study cadence (as committed)", {"algorithm": "set"}),
    "rigl": ("RigL, study cadence (as committed)", {"algorithm": "rigl"}),
    "granet": ("GraNet 50→80%, study cadence (as committed)", {"algorithm": "granet"}),
    "rigl_vmean": ("RigL as committed, regrown v = layer mean", {"algorithm": "rigl", "adam": "v_mean"}),
    "set_vmean": ("SET as committed, regrown v = layer mean", {"algorithm": "set", "adam": "v_mean"}),
    "rigl_fix": ("RigL, regrown-in-place entries keep value + state", {"algorithm": "rigl", "code": "new"}),
    "set_fix": ("SET, regrown-in-place entries keep value + state", {"algorithm": "set", "code": "new"}),
    "granet_fix": ("GraNet, regrown-in-place entries keep value + state",
                   {"algorithm": "granet", "code": "new"}),
    "rigl_fix_vmean": ("RigL fixed + regrown v = layer mean",
                       {"algorithm": "rigl", "code": "new", "adam": "v_mean"}),
    "set_fix_vmean": ("SET fixed + regrown v = layer mean",
                      {"algorithm": "set", "code": "new", "adam": "v_mean"}),
    "rigl_fix_normal": ("RigL fixed + grow_init random_normal",
                        {"algorithm": "rigl", "code": "new", "grow_init": "random_normal"}),
    "rigl_fix_initdist": ("RigL fixed + grow_init initial_dist",
                          {"algorithm": "rigl", "code": "new", "grow_init": "initial_dist"}),
    "rigl_fix_bal": ("RigL fixed + equal non-zeros per pair of output rows (balance_out_groups 32)",
                     {"algorithm": "rigl", "code": "new", "balance_out_groups": 32}),
    "rigl_fix_row": ("RigL fixed + equal non-zeros in every output row (constant fan-in)",
                     {"algorithm": "rigl", "code": "new", "balance": "rows"}),
    "rigl_fix_bal_dt100": ("RigL fixed + balance_out_groups 32 + ΔT = 100",
                           {"algorithm": "rigl", "code": "new", "balance_out_groups": 32,
                            "update_every": 100}),
    "granet_fix_bal_dt100": ("GraNet fixed + balance_out_groups 32 + ΔT = 100",
                             {"algorithm": "granet", "code": "new", "balance_out_groups": 32,
                              "update_every": 100}),
    "rigl_fix_bal_erk": ("RigL fixed + balance_out_groups 32 + ERK",
                         {"algorithm": "rigl", "code": "new", "balance_out_groups": 32,
                          "distribution": "erk"}),
    "rigl_fix_bal_normal": ("RigL fixed + balance_out_groups 32 + grow_init random_normal",
                            {"algorithm": "rigl", "code": "new", "balance_out_groups": 32,
                             "grow_init": "random_normal"}),
    "granet_fix_bal": ("GraNet fixed + balance_out_groups 32",
                       {"algorithm": "granet", "code": "new", "balance_out_groups": 32}),
    "rigl_fix_balin": ("RigL fixed + equal non-zeros per pair of input columns (balance_in_groups 32)",
                       {"algorithm": "rigl", "code": "new", "balance_in_groups": 32}),
    "rigl_fix_dt100": ("RigL fixed + ΔT = 100", {"algorithm": "rigl", "code": "new", "update_every": 100}),
    "set_fix_dt100": ("SET fixed + ΔT = 100", {"algorithm": "set", "code": "new", "update_every": 100}),
    "rigl_fix_drop01": ("RigL fixed + drop fraction 0.1", {"algorithm": "rigl", "code": "new", "drop": 0.1}),
    "static_erk": ("Static, ERK", {"algorithm": "static", "distribution": "erk"}),
    "rigl_fix_erk": ("RigL fixed + ERK", {"algorithm": "rigl", "code": "new", "distribution": "erk"}),
    "set_fix_erk": ("SET fixed + ERK", {"algorithm": "set", "code": "new", "distribution": "erk"}),
    "static_3k": ("Static, 3000 steps", {"algorithm": "static", "steps": 3000}),
    "rigl_fix_3k": ("RigL fixed, 3000 steps", {"algorithm": "rigl", "code": "new", "steps": 3000}),
    "rigl_fix_bal_3k": ("RigL fixed + balance_out_groups 32, 3000 steps",
                        {"algorithm": "rigl", "code": "new", "balance_out_groups": 32, "steps": 3000}),
    "set_fix_3k": ("SET fixed, 3000 steps", {"algorithm": "set", "code": "new", "steps": 3000}),
    "rigl_3k": ("RigL as committed, 3000 steps", {"algorithm": "rigl", "steps": 3000}),
    "set_3k": ("SET as committed, 3000 steps", {"algorithm": "set", "steps": 3000}),
    "static_mini": ("Static, mini", {"algorithm": "static", "preset": "mini"}),
    "rigl_fix_mini": ("RigL fixed, mini", {"algorithm": "rigl", "code": "new", "preset": "mini"}),
    "rigl_fix_bal_mini": ("RigL fixed + balance_out_groups 32, mini (4 layers, 128 wide)",
                          {"algorithm": "rigl", "code": "new", "preset": "mini",
                           "balance_out_groups": 32}),
    "set_fix_mini": ("SET fixed, mini", {"algorithm": "set", "code": "new", "preset": "mini"}),
}
# The product's own model (`models/` of this checkout: ModelZoo names and initialisation) at
# the reference study's cadence (ΔT = 100), where RigL's growth is balanced per output row or
# per input column: run with --code new --sparsity-root . --workers-root .
PRODUCT = {"code": "new", "workers": "product", "update_every": 100}
BALANCINGS = {
    "": ("", {}),
    "_bal": (" + balance_out_groups 32", {"balance_out_groups": 32}),
    "_row": (" + one group per output row (constant fan-in)", {"balance": "rows"}),
    "_balin": (" + balance_in_groups 32", {"balance_in_groups": 32}),
    "_col": (" + one group per input column (constant fan-out)", {"balance": "cols"}),
}
SCALES = {"": ("", {}), "_mini": (", mini", {"preset": "mini"}),
          "_3k": (", 3000 steps", {"steps": 3000})}
for scale, (scale_text, scale_cfg) in SCALES.items():
    ROWS[f"prod_static{scale}"] = (f"Static{scale_text}, product model",
                                   {**PRODUCT, "algorithm": "static", **scale_cfg})
    ROWS[f"prod_set{scale}"] = (f"SET{scale_text}, product model",
                                {**PRODUCT, "algorithm": "set", **scale_cfg})
    for algorithm in ("rigl", "granet"):
        for suffix, (text, cfg) in BALANCINGS.items():
            ROWS[f"prod_{algorithm}{suffix}{scale}"] = (
                f"{'RigL' if algorithm == 'rigl' else 'GraNet'}{text}{scale_text}, product model",
                {**PRODUCT, "algorithm": algorithm, **cfg, **scale_cfg})
    for algorithm, label in (("rigl", "RigL"), ("granet", "GraNet")):
        ROWS[f"prod_{algorithm}_sinkhorn{scale}"] = (
            f"{label} growing by the gradient magnitude rescaled to equal row and column sums "
            f"(grow_score_scaling sinkhorn){scale_text}, product model",
            {**PRODUCT, "algorithm": algorithm, "grow_score_scaling": "sinkhorn", **scale_cfg})
    ROWS[f"prod_rigl_fresh{scale}"] = (
        f"RigL that cannot grow back what it just dropped{scale_text}, product model "
        "(diagnostic: research/rigl_diagnostics.py)",
        {**PRODUCT, "algorithm": "rigl_diagnostics.FreshRigL", **scale_cfg})
DEFAULTS = {"code": "head", "workers": "head", "update_every": STUDY["update_every"],
            "drop": STUDY["drop"], "distribution": "uniform", "grow_init": None,
            "balance_out_groups": None, "balance_in_groups": None, "balance": None,
            "grow_score_scaling": None, "adam": "zero", "preset": "tiny", "steps": 1000,
            "algorithm": "dense"}
# (hidden size, FFN size) of the presets, for one balance group per row or per column.
PRESET_WIDTHS = {"tiny": (64, 160), "mini": (128, 352)}


def row_settings(name: str) -> dict[str, Any]:
    if name not in ROWS:
        raise ValueError(f"unknown row {name!r}; choose from {sorted(ROWS)}")
    return {**DEFAULTS, **ROWS[name][1]}


def sparsity_section(cfg: dict[str, Any], seed: int) -> Any:
    if cfg["algorithm"] == "dense":
        return None
    section: dict[str, Any] = {"algorithm": cfg["algorithm"], "sparsity": SPARSITY, "seed": seed}
    if cfg["distribution"] != "uniform":
        section["distribution"] = cfg["distribution"]
    if cfg["algorithm"] == "static":
        return section
    stop = int(cfg["steps"] * STUDY["stop_fraction"])
    section["update"] = {"freq": cfg["update_every"], "stop": stop}
    section["drop_fraction"] = {"type": "cosine", "init": cfg["drop"], "half_period": stop}
    if cfg["algorithm"] == "granet":
        section["init_sparsity"] = 0.5
    for key in ("grow_init", "balance_out_groups", "balance_in_groups", "grow_score_scaling"):
        if cfg[key] is not None:
            section[key] = cfg[key]
    hidden, ffn = PRESET_WIDTHS[cfg["preset"]]
    if cfg["balance"] == "rows":  # one group per output row: FFN-up layers have `ffn` of them
        wide = ["*gate_proj.weight", "*up_proj.weight", "*ffn.0.linear_layer*.weight"]
        return [{**section, "param_filter": wide, "balance_out_groups": ffn},
                {**section, "balance_out_groups": hidden}]
    if cfg["balance"] == "cols":  # one group per input column: FFN-down layers have `ffn`
        wide = ["*down_proj.weight", "*ffn.1.linear_layer.weight"]
        return [{**section, "param_filter": wide, "balance_in_groups": ffn},
                {**section, "balance_in_groups": hidden}]
    return section


def lr_at(step: int, steps: int) -> float:
    """The study's warmup-cosine rate for the step about to be taken (0-based)."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * progress)) * (PEAK_LR - MIN_LR)


def seed_regrown_second_moment(optimizer: Any, alg: Any, before: dict[str, Any]) -> None:
    """Give weights grown by the last update the layer's mean Adam second moment over the weights
    it kept, so their first steps are as large as their neighbours' instead of ~3x larger (zero
    moments under a global bias-correction count: m/sqrt(v) = 0.1g/sqrt(0.001g²) ≈ 3.2)."""
    for name, param, mask in alg.sparse_parameters():
        state = optimizer.state.get(param, {})
        if "exp_avg_sq" not in state:
            continue
        grown = mask & ~before[name]
        kept = mask & before[name]
        if grown.any() and kept.any():
            state["exp_avg_sq"][grown] = state["exp_avg_sq"][kept].mean()


def mask_structure(alg: Any) -> dict[str, float]:
    """How evenly the active weights spread over neurons, averaged over the sparse layers: the
    share of output rows / input columns left with no active weight, and the coefficient of
    variation of the active count per row and per column."""
    dead_rows, dead_cols, row_cv, col_cv = [], [], [], []
    for _, _, mask in alg.sparse_parameters():
        rows, cols = mask.sum(1).double(), mask.sum(0).double()
        dead_rows.append(float((rows == 0).double().mean()))
        dead_cols.append(float((cols == 0).double().mean()))
        row_cv.append(float(rows.std() / rows.mean()) if rows.mean() > 0 else 0.0)
        col_cv.append(float(cols.std() / cols.mean()) if cols.mean() > 0 else 0.0)
    return {"dead_rows": statistics.fmean(dead_rows), "dead_cols": statistics.fmean(dead_cols),
            "row_cv": statistics.fmean(row_cv), "col_cv": statistics.fmean(col_cv)}


def run_one(name: str, seed: int) -> dict[str, Any]:
    import torch

    import sparsity
    from training.text import BatchSampler, encode_documents, eval_batches, load_splits, make_tokenizer
    from models.config import preset_config
    from models.transformer import build_model

    torch.set_num_threads(1)
    cfg = row_settings(name)
    splits = load_splits("builtin:shakespeare")
    tokenizer = make_tokenizer("byte", None, splits.train)
    train_tokens = encode_documents(tokenizer, splits.train)
    eval_data = eval_batches(encode_documents(tokenizer, splits.validation), batch_size=BATCH,
                             seq_len=SEQ_LEN, steps=EVAL_BATCHES)
    config = preset_config(cfg["preset"], vocab_size=tokenizer.vocab_size)
    model = build_model(config, seed=seed)
    section = sparsity_section(cfg, seed)
    alg = sparsity.configure(section) if section else None
    if alg is not None:
        alg.apply(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=PEAK_LR, weight_decay=WEIGHT_DECAY, fused=True)
    if alg is not None:
        alg.apply(optimizer)
    sampler = BatchSampler(train_tokens, batch_size=BATCH, seq_len=SEQ_LEN, seed=seed, shuffle=True)
    steps, started, train_loss = cfg["steps"], time.perf_counter(), []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        inputs, targets = sampler.next_batch()
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        loss.backward()
        if alg is not None:
            alg.mask_gradients()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        updating = alg is not None and alg.is_update_step(step + 1)
        before = {n: m.clone() for n, _, m in alg.sparse_parameters()} if updating else None
        optimizer.step()
        if before is not None and cfg["adam"] == "v_mean":
            seed_regrown_second_moment(optimizer, alg, before)
        train_loss.append(loss.item())
    model.eval()
    with torch.no_grad():
        eval_loss = statistics.fmean(float(model(x, y)[1]) for x, y in eval_data)
    metrics = alg.metrics() if alg is not None else {}
    return {"row": name, "seed": seed, "settings": cfg, "sparsity_section": section,
            "sparsity_file": sparsity.__file__, "eval_loss": eval_loss,
            "eval_ppl": math.exp(eval_loss),
            "train_loss_last100": statistics.fmean(train_loss[-100:]),
            "itop_rate": metrics.get("mask/itop_rate"),
            "global_sparsity": metrics.get("sparsity/global"),
            "mask_structure": mask_structure(alg) if alg is not None else None,
            "layer_density": {n: float(m.double().mean()) for n, _, m in alg.sparse_parameters()}
            if alg is not None else {},
            "wall_s": time.perf_counter() - started}


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def render() -> None:
    runs = [json.loads(line) for line in RAW.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_row: dict[str, list[dict[str, Any]]] = {}
    for run in runs:  # a rerun of (row, code, seed) replaces the earlier one
        rows = by_row.setdefault((run["row"], run["settings"]["code"]), [])
        rows[:] = [r for r in rows if r["seed"] != run["seed"]] + [run]
    table = []
    known = [key for key in by_row if key[0] in ROWS]  # rows since dropped from ROWS: not shown
    for name, code in sorted(known, key=lambda key: (list(ROWS).index(key[0]), key[1])):
        rows = sorted(by_row[name, code], key=lambda r: r["seed"])
        ppl, loss = mean_sd([r["eval_ppl"] for r in rows]), mean_sd([r["eval_loss"] for r in rows])
        itop = [r["itop_rate"] for r in rows if r["itop_rate"] is not None]
        structure = [r["mask_structure"] for r in rows if r.get("mask_structure")]
        table.append({"row": name, "description": ROWS[name][0], "settings": rows[0]["settings"],
                      "seeds": [r["seed"] for r in rows], "ppl_mean": ppl[0], "ppl_sd": ppl[1],
                      "loss_mean": loss[0], "loss_sd": loss[1],
                      "ppl_per_seed": [r["eval_ppl"] for r in rows],
                      "itop_rate": statistics.fmean(itop) if itop else None,
                      "mask_structure": {k: statistics.fmean(m[k] for m in structure)
                                         for k in structure[0]} if structure else None,
                      "layer_density": {n: statistics.fmean(r["layer_density"][n] for r in rows)
                                        for n in rows[-1].get("layer_density") or {}}
                      if all("layer_density" in r for r in rows) else None,
                      "wall_s_mean": statistics.fmean(r["wall_s"] for r in rows)})
    walls = [r["wall_s"] for rows in by_row.values() for r in rows]
    wall = (f"{len(walls)} runs, {sum(walls) / 60:.0f} min of run time in all; one run took "
            f"{min(walls):.0f} s alone on a core and up to {max(walls):.0f} s while the 2-core "
            "machine was shared with other work.")
    (RESULTS / "rigl_cause.json").write_text(json.dumps({"rows": table, "wall": wall}, indent=1),
                                             encoding="utf-8")
    lines = ["| row | what changes | code | final eval ppl (mean ± sd) | eval loss | per seed | ITOP | s/run |",
             "|---|---|---|---|---|---|---|---|"]
    for t in table:
        sd = lambda v, s: f"{v:.3f} ± {s:.3f}" if len(t["seeds"]) > 1 else f"{v:.3f}"  # noqa: E731
        itop = f"{t['itop_rate']:.2f}" if t["itop_rate"] is not None else "—"
        lines.append(f"| `{t['row']}` | {t['description']} | {t['settings']['code']} | "
                     f"{sd(t['ppl_mean'], t['ppl_sd'])} | {sd(t['loss_mean'], t['loss_sd'])} | "
                     f"{', '.join(f'{p:.3f}' for p in t['ppl_per_seed'])} | {itop} | "
                     f"{t['wall_s_mean']:.0f} |")
    (RESULTS / "rigl_cause.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("run", "render"))
    parser.add_argument("--rows", default="static,set,rigl")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--code", choices=("head", "new"), default="head",
                        help="which rows this invocation may run (the sparsity code they need)")
    parser.add_argument("--sparsity-root", default=str(ROOT),
                        help="directory holding the sparsity package to run")
    parser.add_argument("--workers-root", default=str(ROOT),
                        help="directory holding the workers package (model, data)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one thread each")
    parser.add_argument("--raw", type=Path, default=RAW, help="JSON-lines file runs append to")
    args = parser.parse_args()
    if args.command == "render":
        render()
        return 0
    for root in (args.workers_root, args.sparsity_root):  # sparsity's root ends up first
        sys.path.insert(0, str(Path(root).resolve()))
    names = args.rows.split(",")
    product = Path(args.workers_root).resolve() == ROOT
    for name in names:  # rows that name no code run on either
        if row_settings(name)["code"] == "new" and args.code != "new":
            raise SystemExit(f"row {name!r} needs --code new")
        if row_settings(name)["workers"] == "product" and not product:
            raise SystemExit(f"row {name!r} needs --workers-root {ROOT}")
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    tasks = [(name, int(seed)) for seed in args.seeds.split(",") for name in names]
    with multiprocessing.Pool(args.jobs) as pool:  # fork: the workers inherit sys.path
        for result in pool.imap_unordered(_run_task, tasks):
            result["settings"]["code"] = args.code
            with args.raw.open("a", encoding="utf-8") as out:
                out.write(json.dumps(result) + "\n")
            print(f"{result['row']:<22} seed {result['seed']}: ppl {result['eval_ppl']:.3f} "
                  f"loss {result['eval_loss']:.4f} in {result['wall_s']:.0f} s "
                  f"({result['sparsity_file']})", flush=True)
    return 0


def _run_task(task: tuple[str, int]) -> dict[str, Any]:
    return run_one(*task)


if __name__ == "__main__":
    sys.exit(main())
