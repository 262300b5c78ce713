"""docs/results.md's GPU section: `make gpu-check`'s figures (bench/results/gpu_check.json), ours
beside nanoGPT on the device the check names, or, before any GPU run of it, that they are to
come and what the one earlier GPU run measured (issue 42).

    python research/gpu_report.py      # after a GPU run's bench/results/gpu_check.json

research/study_results.py renders it too whenever it rewrites the page.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPU_RESULTS = REPO / "bench" / "results" / "gpu_check.json"
RESULTS_MD = REPO / "docs" / "results.md"
TITLE = "## On a GPU, beside nanoGPT (`make gpu-check`)"
BEFORE = "## `make results`"  # the section goes before the CPU study's own
TARGETS = (("dense_vs_nanogpt_eager", "ours dense eager ÷ nanoGPT eager, tokens/s", ">= 1.0"),
           ("dense_vs_nanogpt_compiled", "ours dense compiled ÷ nanoGPT compiled, tokens/s", ">= 0.9"),
           ("masked_vs_dense_step", "RigL 80% step ÷ dense step, compiled", "<= 1.05"),
           ("masked_vs_dense_step_eager", "RigL 80% step ÷ dense step, eager", "<= 1.05"))
# Measured before issue 42's changes, on one H100 80GB (torch 2.11, CUDA 13): nanoGPT on its own
# input.txt, not our corpus; ours evaluating with dropout on (since fixed).
EARLIER = [
    "| run | tokens/s (ms a step) | best val loss | val loss at 5,000 |",
    "|---|---|---|---|",
    "| nanoGPT train.py, compiled (its default) | ~1.13M (14.5) | 1.4685 (step 1,750) | 1.7125 |",
    "| nanoGPT train.py, `--compile=False` | ~819k (20) | – | – |",
    "| ours dense, bf16 | 564k (29) | 1.514 | 1.750 |",
    "| ours at 80%, three sharing the GPU | RigL 449k, SET 436k, GraNet 408k | "
    "GraNet 1.504, RigL 1.512, SET 1.523, Static 1.555 | same |",
]


def gpu_section(result: dict[str, Any] | None) -> list[str]:
    lines = [TITLE, ""]
    if result is None or not result.get("cuda"):
        return lines + [
            "No GPU has run `make gpu-check` since issue 42's changes to the GPU step (no per-step "
            "host reads, the fused optimizer, one q/k/v matmul, batched masking, `torch.compile` "
            "by default; [the GPU check](benchmarks.md#the-gpu-check)): the machine they were "
            "written on had none. The next GPU run writes `bench/results/gpu_check.json`, and "
            "`python research/gpu_report.py` puts its figures here.", "",
            "What the one earlier GPU run measured, before those changes (issue 42: one H100 80GB, "
            "torch 2.11, CUDA 13; nanoGPT on its own `input.txt`, not our corpus; "
            "our evaluation then still with dropout on; SET, RigL and GraNet crashed at their "
            "first mask update until a mask-statistics tensor followed the model to the GPU):", "",
            *EARLIER, ""]
    lines += [f"Measured by `make gpu-check` on {result['device']} (torch {result['torch']}, CUDA "
              f"{result['torch_cuda']}) in {result.get('wall_s', 0) / 60:.1f} min: the loss runs "
              f"train the first {result['loss_steps']} steps of nanoGPT's 5,000-step schedule; "
              "tokens/s with each run alone on the GPU, the five algorithms' loss runs sharing it. "
              "Raw numbers: `bench/results/gpu_check.json`.", "",
              "| run | tokens/s | MFU (nanoGPT's estimate) | best val loss | final val loss |",
              "|---|---|---|---|---|"]
    speed, mfu = result.get("tokens_per_s", {}), result.get("mfu", {})
    best, final = result.get("best_val_loss", {}), result.get("final_val_loss", {})
    for name in sorted(set(speed) | set(best)):
        lines.append(f"| {name} | {_fmt(speed.get(name), ',.0f')} | {_fmt(mfu.get(name), '.1%')} | "
                     f"{_fmt(best.get(name), '.4f')} | {_fmt(final.get(name), '.4f')} |")
    lines += ["", "| target | measured | goal |", "|---|---|---|"]
    lines += [f"| {label} | {_fmt(result.get(key), '.3f')} | {goal} |" for key, label, goal in TARGETS]
    dense, theirs = result.get("dense_best_val_loss"), result.get("nanogpt_best_val_loss")
    lines += [f"| best val loss, ours dense − nanoGPT | {_fmt(dense - theirs, '+.4f') if dense and theirs else '–'}"
              " | <= 0.02 |", "",
              f"GPU tests: {result['gpu_tests']}. Masks, GPU against CPU: "
              + (", ".join(f"{k}: {v}" for k, v in result["masks"].items())
                 if isinstance(result["masks"], dict) else str(result["masks"])) + ".", ""]
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def insert_gpu_section(results_md: Path, result: dict[str, Any] | None) -> None:
    """The section in place of the page's own GPU section, else before `make results`'s (else
    at the end)."""
    text = results_md.read_text(encoding="utf-8")
    section = "\n".join(gpu_section(result))
    if TITLE in text:
        start = text.index(TITLE)
        end = text.find("\n## ", start + len(TITLE))
        text = text[:start] + section + ("\n" + text[end + 1:] if end != -1 else "")
    elif BEFORE in text:
        at = text.index(BEFORE)
        text = text[:at] + section + "\n" + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    results_md.write_text(text, encoding="utf-8")


def main() -> int:
    result = json.loads(GPU_RESULTS.read_text(encoding="utf-8")) if GPU_RESULTS.exists() else None
    insert_gpu_section(RESULTS_MD, result)
    print(f"wrote {RESULTS_MD}'s GPU section ({'from ' + str(GPU_RESULTS) if result else 'no GPU run yet'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
