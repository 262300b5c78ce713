"""Why did dense miss nanoGPT's best validation loss at its GPU configuration (issue 42: 1.514
against 1.4685, dropout 0.2), while matching it at the baby-GPT shape (dropout 0)?

Suspect: our evaluation ran with the model in training mode, so dropout stayed on while
validation loss was measured (nanoGPT's estimate_loss switches to eval mode). This runs the
baby-GPT configuration (examples/study_baby_gpt.yaml's model and recipe) with dropout 0.2 on
a CPU, keeps a checkpoint at every evaluation, and measures each checkpoint's validation loss
both ways: with dropout on (what the loop reported before the fix) and off (what it reports
now). With ``--nanogpt DIR`` (a nanoGPT checkout the user fetched: its code is not shipped
here) it also trains nanoGPT's own train.py on the same token streams, same configuration,
side by side, so the anchor is the same data, not a different cut of the plays.

    python research/eval_mode_gap.py [--steps 2000] [--dropout 0.2] [--nanogpt DIR]

Writes research/results/eval_mode_gap.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from csx_config import JobSpec  # noqa: E402
from training.build import build_run  # noqa: E402
from training.checkpoint import list_checkpoints, load_checkpoint  # noqa: E402
from bench.gpu_check import write_nanogpt_data  # noqa: E402
from training.loop import evaluate, train  # noqa: E402
from training.plan import plan_job  # noqa: E402

STUDY = REPO / "examples" / "study_baby_gpt.yaml"
OUT = REPO / "research" / "results" / "eval_mode_gap.json"
NANOGPT_EVAL = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def params(steps: int, dropout: float) -> dict:
    study = yaml.safe_load(STUDY.read_text(encoding="utf-8"))
    model = {**study["model"], "dropout_rate": dropout, "attention_dropout_rate": dropout}
    schedule = study["optimizer"]["learning_rate"]
    schedule[1]["total_iters"] = steps - schedule[0]["total_iters"]
    runconfig = {**study["runconfig"], "max_steps": steps, "checkpoint_steps": 250,
                 "mlflow_experiment": ""}
    for key in ("num_csx", "cpus_per_csx"):
        runconfig.pop(key)
    return {"train_input": study["train_input"], "eval_input": study["eval_input"],
            "model": model, "optimizer": study["optimizer"], "runconfig": runconfig}


def ours(spec: JobSpec, folder: Path) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    summary = train(plan_job(spec), model_dir=str(folder))
    wall_s = time.perf_counter() - start
    run = build_run(plan_job(spec), folder / "eval", rank=0, device=torch.device("cpu"))
    rows = []
    for step, path in list_checkpoints(folder):
        run.model.load_state_dict(load_checkpoint(path)["model"])
        eval_mode = evaluate(run, None)["eval/loss"]
        torch.manual_seed(step)
        with torch.no_grad():  # the loop before the fix: training mode, dropout drawn
            train_mode = sum(float(run.model(x, y)[1]) for x, y in run.eval_data) / len(run.eval_data)
        rows.append({"step": step, "val_loss_eval_mode": eval_mode, "val_loss_train_mode": train_mode})
    return {"wall_s": wall_s, "tokens_per_s": summary["tokens_per_s"], "checkpoints": rows,
            "best_eval_mode": min(r["val_loss_eval_mode"] for r in rows),
            "best_train_mode": min(r["val_loss_train_mode"] for r in rows)}


def nanogpt(checkout: Path, spec: JobSpec, steps: int, dropout: float, folder: Path) -> dict:
    """nanoGPT's train.py on our token streams (bytes, vocabulary 256), its CPU command with
    the baby-GPT shape and the given dropout."""
    work = folder / "nanogpt"
    shutil.copytree(checkout, work, ignore=shutil.ignore_patterns(".git"))
    write_nanogpt_data(work / "data" / "csx_bytes", spec.train_input.data_dir)
    command = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--dataset=csx_bytes",
               "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=100",
               "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
               f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--dropout={dropout}",
               "--eval_interval=250", "--always_save_checkpoint=False", "--wandb_log=False"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if done.returncode:
        raise RuntimeError(f"nanoGPT failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    evals = [{"step": int(s), "train_loss": float(t), "val_loss": float(v)}
             for s, t, v in NANOGPT_EVAL.findall(done.stdout)]
    return {"wall_s": time.perf_counter() - start, "evals": evals,
            "best_val_loss": min(e["val_loss"] for e in evals), "command": " ".join(command)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout, run side by side")
    args = parser.parse_args()
    spec = JobSpec.from_yaml(yaml.safe_dump(params(args.steps, args.dropout)))
    with tempfile.TemporaryDirectory() as tmp:
        result = {"command": " ".join(["python", "research/eval_mode_gap.py", *sys.argv[1:]]),
                  "cpu": _cpu(), "steps": args.steps, "dropout": args.dropout,
                  "ours": ours(spec, Path(tmp) / "ours")}
        if args.nanogpt:
            result["nanogpt"] = nanogpt(args.nanogpt, spec, args.steps, args.dropout, Path(tmp))
    OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result["ours"].items() if k != "checkpoints"}, indent=1))
    if "nanogpt" in result:
        print("nanoGPT best val loss", result["nanogpt"]["best_val_loss"])


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
