"""`make gpu-check` where the suite runs, without a GPU (issue 42): its CPU side and JSON, its
measurement of tokens/s, how it reads nanoGPT's log, the CUDA build of torch it asks for, and
the offline install of the bundle a GPU machine without network gets."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = load("bench/gpu_check.py")
REQUIRED = {"device", "cuda", "gpu_tests", "masks", "masked_vs_dense_step", "dense_vs_nanogpt_eager",
            "dense_vs_nanogpt_compiled", "dense_best_val_loss", "nanogpt_best_val_loss"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, make gpu-check runs the GPU check")
def test_without_cuda_it_exercises_its_cpu_side_and_reports_a_missing_nanogpt(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-nanogpt-here"
    monkeypatch.setenv("NANOGPT", str(missing))
    assert gpu_check.main(["--json", str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert REQUIRED <= set(result)
    assert result["cuda"] is False and result["gpu_tests"] == result["masks"] == "skipped: no CUDA device"
    assert result["nanogpt"].startswith("not run:") and str(missing) in result["nanogpt"]
    assert [result["cpu_side"][name].split(",")[0] for name in ("dense", "rigl")] == ["4 steps", "4 steps"]
    assert "no CUDA device" in capsys.readouterr().out


def test_tokens_per_s_is_the_wall_clock_between_log_steps_after_warmup_and_outside_evaluations():
    # a log step every 10 steps, 10 steps a second; the window holding step 250's evaluation
    # took 100 s more, the first windows (warm-up, compilation) 5 s each, the last (the final
    # checkpoint) 50 s
    times, clock = [[0, 0.0]], 0.0
    for step in range(10, 301, 10):
        clock += 5.0 if step <= 50 else 1.0 + (100.0 if step == 250 else 50.0 if step == 300 else 0.0)
        times.append([step, clock])
    assert gpu_check.tokens_per_s(times, 1000, warmup=50) == pytest.approx(1000 * 10)
    assert gpu_check.tokens_per_s(times[:2], 1000, warmup=50) is None  # nothing after warm-up


def test_nanogpt_runs_on_our_data_and_its_log_is_read(tmp_path):
    """A stand-in for nanoGPT's train.py, printing its log format, shows what the check passes
    (config, our data folder, its step count, compile) and reads back (each log line's arrival,
    the validation losses, its MFU estimate)."""
    checkout = tmp_path / "nanogpt"
    (checkout / "config").mkdir(parents=True)
    (checkout / "config" / "train_shakespeare_char.py").write_text("")
    (checkout / "train.py").write_text(
        "import sys\nprint('args', sys.argv[1:])\n"
        "print('step 0: train loss 5.5000, val loss 5.5100')\n"
        "for i in (0, 10, 20):\n    print(f'iter {i}: loss 2.0, time 14.50ms, mfu 24.{i}%')\n"
        "print('step 20: train loss 1.2000, val loss 1.4685')\n")
    found, status = gpu_check.nanogpt_checkout(checkout)
    assert found == checkout and status == str(checkout)
    run = gpu_check.run_nanogpt(checkout, tmp_path / "data", tmp_path / "out", compiled=False, steps=20,
                                device="cpu", extra=["--n_layer=2"], timeout=60)
    assert run["eval_history"] == [(0, 5.51), (20, 1.4685)] and run["nanogpt_mfu"] == pytest.approx(0.242)
    assert [step for step, _ in run["log_times"]] == [0, 10, 20]
    assert f"--dataset={tmp_path / 'data'}" in run["command"] and "--compile=False" in run["command"]
    assert run["command"][-1] == "--n_layer=2"
    assert gpu_check.nanogpt_checkout(tmp_path)[1].startswith(f"not run: {tmp_path} is not a nanoGPT checkout")


def test_the_variants_sections_configure():
    import sparsity

    for name, section in gpu_check.VARIANTS.items():
        algorithm = sparsity.configure(gpu_check.JobSpec.from_yaml("{}", [f"sparsity={section}"]).sparsity)
        assert type(algorithm).__name__.lower() == name


cuda_torch = load("tools/cuda_torch.py")


@pytest.mark.parametrize("driver, tag", [((13, 1), "cu130"), ((12, 8), "cu128"), ((12, 7), "cu126"),
                                         ((12, 2), "cu121"), ((11, 8), "cu118"), ((11, 4), None)])
def test_a_driver_gets_the_newest_cuda_build_it_runs(driver, tag):
    assert cuda_torch.cuda_index(driver) == (None if tag is None else f"https://download.pytorch.org/whl/{tag}")


def test_a_cpu_torch_is_replaced_by_the_same_version_built_for_cuda_where_a_driver_is(monkeypatch, capsys):
    builds = iter([("2.13.0+cpu", None), ("2.13.0+cu128", "12.8")])
    calls = []
    monkeypatch.setattr(cuda_torch, "installed_torch", lambda: next(builds))
    monkeypatch.setattr(cuda_torch, "driver_cuda", lambda: (12, 8))
    monkeypatch.setattr(cuda_torch.subprocess, "run", lambda command, **_: calls.append(command))
    assert cuda_torch.main() == 0
    assert calls == [[sys.executable, "-m", "pip", "install", "--force-reinstall", "torch==2.13.0",
                      "--index-url", "https://download.pytorch.org/whl/cu128"]]
    assert capsys.readouterr().out.splitlines()[-1] == "torch 2.13.0+cu128: a CUDA 12.8 build"


def test_without_a_driver_torch_is_left_as_it_is(monkeypatch, capsys):
    monkeypatch.setattr(cuda_torch, "driver_cuda", lambda: None)
    monkeypatch.setattr(cuda_torch.subprocess, "run", lambda *a, **k: pytest.fail("nothing to install"))
    monkeypatch.setattr(cuda_torch, "installed_torch", lambda: ("2.13.0+cpu", None))
    assert cuda_torch.main() == 0
    assert "a CPU build (no NVIDIA driver here" in capsys.readouterr().out


gpu_bundle = load("tools/gpu_bundle.py")


@pytest.mark.parametrize("has_pip", [True, False], ids=["pip", "unpacked"])
def test_the_bundle_installs_offline_for_a_plain_python(tmp_path, has_pip):
    """A wheel in the bundle (here one made on the spot) lands in the target folder, by pip
    with --no-index or unpacked, and a Python without site-packages imports it from there."""
    wheels = tmp_path / "bundle" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "probe_pkg-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("probe_pkg/__init__.py", "ANSWER = 42\n")
        wheel.writestr("probe_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: probe-pkg\nVersion: 1.0\n")
        wheel.writestr("probe_pkg-1.0.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("probe_pkg-1.0.dist-info/RECORD", "")
    gpu_bundle.install(tmp_path / "bundle", tmp_path / "site", has_pip=has_pip)
    out = subprocess.run([sys.executable, "-I", "-S", "-c",
                          f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); "
                          "import probe_pkg; print(probe_pkg.ANSWER)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"


def test_the_results_page_says_the_gpu_figures_are_to_come_until_a_gpu_run_gives_them(tmp_path):
    """docs/results.md's GPU section: before a GPU run of the check, no figure of it (the earlier
    run's, labelled as such); after one, its device and figures; rendered twice, one section."""
    sys.path.insert(0, str(ROOT))
    from research.gpu_report import TITLE, gpu_section, insert_gpu_section

    page = tmp_path / "results.md"
    page.write_text("# Results\n\n## First\n\ntext\n\n## `make results`: the study\n\nmore\n", encoding="utf-8")
    insert_gpu_section(page, None)
    text = page.read_text(encoding="utf-8")
    assert text.index("## First") < text.index(TITLE) < text.index("## `make results`")
    assert "No GPU has run `make gpu-check` since issue 42's changes" in text
    cpu_side = json.loads(json.dumps({"cuda": False, "device": "cpu (no CUDA device)"}))
    assert gpu_section(cpu_side) == gpu_section(None)  # a CPU run's JSON is no GPU figure
    measured = {"cuda": True, "device": "NVIDIA H200", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
                "wall_s": 300.0, "loss_steps": 1500, "gpu_tests": "passed",
                "masks": {"rigl": "equal at the first update (step 5)"},
                "tokens_per_s": {"dense_compiled": 1.2e6, "nanogpt_compiled": 1.1e6},
                "mfu": {"dense_compiled": 0.25}, "best_val_loss": {"dense_compiled": 1.47},
                "final_val_loss": {"dense_compiled": 1.5}, "dense_vs_nanogpt_compiled": 1.0909,
                "dense_best_val_loss": 1.47, "nanogpt_best_val_loss": 1.46}
    insert_gpu_section(page, measured)
    insert_gpu_section(page, measured)
    text = page.read_text(encoding="utf-8")
    assert text.count(TITLE) == 1 and "No GPU has run" not in text
    assert "on NVIDIA H200 (torch 2.11.0+cu130, CUDA 13.0)" in text
    assert "| dense_compiled | 1,200,000 | 25.0% | 1.4700 | 1.5000 |" in text
    assert "| ours dense compiled ÷ nanoGPT compiled, tokens/s | 1.091 | >= 0.9 |" in text
    assert "| best val loss, ours dense − nanoGPT | +0.0100 | <= 0.02 |" in text
    assert text.endswith("more\n") and text.index(TITLE) < text.index("## `make results`")
