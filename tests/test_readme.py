"""Every command in README.md, run on tiny presets.

Python blocks run as scripts; `sparsity:` YAML blocks go through `sparsity.configure`; the
tour's shell blocks run line by line against a local stack (`service.local_stack.LocalStack`,
the stack `make run` starts), with `csx` as `python -m workers.cli`, `examples/*.yaml` swapped
for tiny copies (4 steps) and the API address for the stack's. `make run` itself is
`csx local-study` on examples/study.yaml, covered on a tiny study by
tests/service/test_service_local_stack.py; `make test` is this suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TOUR = README[README.index("## A short tour"):]
README_API = "http://127.0.0.1:8000"
TINY_STEPS = 4


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """Lines of a shell block without their trailing comments."""
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.strip().splitlines()]


def tiny(example: str, folder: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data["train_input"] = {**data["train_input"], "batch_size": 4, "max_sequence_length": 16}
    data["eval_input"] = {"batch_size": 4, "max_sequence_length": 16}
    data["runconfig"] = {**data["runconfig"], "max_steps": TINY_STEPS, "eval_frequency": 2,
                         "eval_steps": 1, "checkpoint_steps": 0, "log_steps": 2}
    if "algorithms" in data:
        data["algorithms"] = ["dense", "rigl"]
    path = folder / example
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from service.local_stack import LocalStack

    with LocalStack(tmp_path_factory.mktemp("stack"), cluster_size=4) as running:
        yield running


@pytest.fixture(scope="module")
def shell(stack, tmp_path_factory):
    """Runs one README line the way a reader would, on tiny inputs, against the stack."""
    folder = tmp_path_factory.mktemp("readme")
    swaps = {f"examples/{name}": str(tiny(name, folder)) for name in ("rigl.yaml", "study.yaml")}
    swaps |= {"runs/rigl": str(folder / "runs" / "rigl"), README_API: stack.api_url,
              "checkpoint_200.mdl": f"checkpoint_{TINY_STEPS}.mdl"}
    env = {**os.environ, "CSX_URL": stack.api_url, "CSX_TOKEN": stack.token,
           "RAY_ADDRESS": f"127.0.0.1:{stack.ray_port}", "RAY_AUTH_MODE": "disabled",
           "MLFLOW_TRACKING_URI": f"sqlite:///{stack.state_dir / 'mlflow.db'}"}

    def run(line: str) -> str:
        for old, new in swaps.items():
            line = line.replace(old, new)
        if line.startswith("csx "):
            line = f"{sys.executable} -m workers.cli {line.removeprefix('csx ')}"
        done = subprocess.run(["bash", "-c", line], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    return run


def test_python_blocks_run():
    for block in blocks(README, "python"):
        done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"{block}\n{done.stderr}"


def test_sparsity_yaml_blocks_configure():
    import sparsity

    sections = [yaml.safe_load(b) for b in blocks(README, "yaml")]
    sections = [s["sparsity"] for s in sections if isinstance(s, dict) and "sparsity" in s]
    assert len(sections) >= 2  # both ModelZoo layouts
    for section in sections:
        assert sparsity.configure(section) is not None


@pytest.mark.slow
def test_modelzoo_porting_block(tmp_path, monkeypatch, capsys):
    """The three porting lines, in process, from a folder with examples/ in it; the training
    line runs 4 steps on one system (the 2-system path: tests/workers/test_workers_modelzoo_e2e.py)."""
    import shlex

    from workers import cli

    section = README[README.index("## Running a Cerebras ModelZoo params file"):README.index("## A short tour")]
    lines = commands(blocks(section, "bash")[0])
    assert len(lines) == 3 and all(line.startswith("csx ") for line in lines)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    swaps = {"runconfig.max_steps=200": f"runconfig.max_steps={TINY_STEPS}", "--num_csx 2": "--num_csx 1"}
    outputs = []
    for line in lines:
        for old, new in swaps.items():
            line = line.replace(old, new)
        assert cli.main(shlex.split(line.removeprefix("csx "))) == 0, line
        outputs.append(capsys.readouterr().out)
    assert "sparsified weights: 72 of 73" in outputs[0] and "speedup vs dense" in outputs[0]
    assert (tmp_path / "data" / "shakespeare" / "data-00000.h5").is_file()
    assert f'"steps": {TINY_STEPS}' in outputs[2]


@pytest.mark.slow
def test_tour_csx_run_block(shell):
    run_block = blocks(TOUR, "bash")[0]
    outputs = [shell(line) for line in commands(run_block)]
    assert "FLOPs/token" in outputs[0]
    assert '"final_eval_perplexity"' in outputs[1]


@pytest.mark.slow
def test_tour_service_block(stack, shell):
    serve, export, *rest = commands(blocks(TOUR, "bash")[1])
    # The stack runs this very command (with a free port) and reads the printed token.
    assert serve == "csx serve --dev-token &"
    assert export.startswith("export CSX_TOKEN=") and stack.token.startswith("csx_")
    outputs = [shell(line) for line in rest]
    assert '"status"' in outputs[0] and '"jobs"' in outputs[1]
    headers = {"Authorization": f"Bearer {stack.token}"}
    studies = [httpx.get(f"{stack.api_url}/v1/studies/{i}", headers=headers).json()
               for i in (1, 2)]
    assert [len(s["jobs"]) for s in studies] == [2, 2]  # study.yaml (tiny: 2 variants), csx study
    jobs = httpx.get(f"{stack.api_url}/v1/jobs", headers=headers).json()
    assert jobs["count"] == 6  # POST /jobs, csx submit, and the 4 variants
