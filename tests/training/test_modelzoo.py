"""Real ModelZoo params files (examples/modelzoo/, written as ModelZoo ships them) validate
unchanged; their patterns select exactly what they select in ModelZoo's naming; a 7B model
validates on the meta device in well under 1 GB; what cannot fit is refused up front."""

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from csx import cli
from training.report import plan_report
from csx_config import JobSpec
from training.plan import plan_job

MODELZOO = Path(__file__).resolve().parents[2] / "examples" / "modelzoo"
FILES = sorted(p.name for p in MODELZOO.glob("*.yaml"))


def modelzoo_weight_names(model: dict) -> list[str]:
    """The matrix names ModelZoo's GPT2LMHeadModel has for these model keys, written out here
    independently of models.config."""
    names = ["embedding_layer.word_embeddings.weight"]
    if model.get("position_embedding_type", "learned") == "learned":
        names.append("embedding_layer.position_embeddings.weight")
    glu = model.get("nonlinearity", "gelu").endswith("glu")
    for i in range(model["num_hidden_layers"]):
        prefix = f"transformer_decoder.layers.{i}"
        names += [f"{prefix}.self_attn.proj_{x}_dense_layer.weight" for x in ("q", "k", "v", "output")]
        names += [f"{prefix}.ffn.ffn.0.linear_layer.weight", f"{prefix}.ffn.ffn.1.linear_layer.weight"]
        names += [f"{prefix}.ffn.ffn.0.linear_layer_for_glu.weight"] if glu else []
    if not model.get("share_embedding_weights", True):
        names.append("lm_head.weight")
    return names


def selected_by_file(section: dict, names: list[str]) -> set[str]:
    if "param_filter" in section:
        return {n for n in names if any(fnmatch.fnmatchcase(n, g) for g in section["param_filter"])}
    return {n for n in names if any(re.search(p, n) for p in section["param_name_patterns"])}


@pytest.mark.parametrize("name", FILES)
def test_modelzoo_file_validates_unchanged_and_selects_what_modelzoo_selects(name, capsys):
    text = (MODELZOO / name).read_text()
    assert cli.main(["run", "--params", str(MODELZOO / name), "--num_csx", "4", "--validate_only"]) == 0
    out = capsys.readouterr().out
    assert "not applied here (hardware-only keys):" in out and "model.mixed_precision" in out
    data = yaml.safe_load(text)
    plan = plan_report(plan_job(JobSpec.from_yaml(text), 4))
    expected = selected_by_file(data["sparsity"], modelzoo_weight_names(data["model"]))
    sparse = {layer["name"] for layer in plan["layers"] if layer["sparse"]}
    assert sparse == expected and len(expected) >= 72
    assert f"sparsified weights: {len(expected)} of" in out
    flops = plan["flops_per_token"]
    assert flops["sparse_train"] < flops["dense_train"]
    assert plan["projection"]["speedup_vs_dense"] > 1.0 and 0 < plan["projection"]["scaling_efficiency"] <= 1.0


def test_plan_numbers_follow_the_file():
    llama = JobSpec.from_yaml((MODELZOO / "params_llama2_7b_rigl80.yaml").read_text())
    plan = plan_report(plan_job(llama, 16))
    assert plan["model"]["parameters"] == 6_738_415_616 and plan["seq_len"] == 4096
    q = next(layer for layer in plan["layers"] if layer["name"].endswith("layers.0.self_attn.proj_q_dense_layer.weight"))
    assert q["shape"] == [4096, 4096] and q["nnz"] == 4096 * 4096 - round(0.8 * 4096 * 4096)
    assert plan["batch_per_csx"] == 64
    granet_spec = JobSpec.from_yaml((MODELZOO / "params_gpt3_xl_granet_cubic.yaml").read_text())
    granet = plan_report(plan_job(granet_spec, 1))
    sparse = [layer for layer in granet["layers"] if layer["sparse"]]
    assert {layer["start_sparsity"] for layer in sparse} == {0.5}  # cubic starts at 50%
    # ... and its last update (stop 18000 is exclusive: step 17000) is 1/18 of the ramp from 80%
    assert granet["schedule"]["final"]["step"] == 17_000
    assert all(layer["sparsity"] == pytest.approx(0.8 - 0.3 / 18**3, abs=1e-6) for layer in sparse)


def test_7b_validates_under_1_gb_of_memory():
    # VmHWM is the peak RSS of this process's own address space. ru_maxrss is not: Linux folds
    # the parent's high-water mark into it at exec, so under a large pytest process it reports
    # the parent's size.
    code = ("from csx import cli; "
            f"rc = cli.main(['run', '--params', {str(MODELZOO / 'params_llama2_7b_rigl80.yaml')!r}, "
            "'--num_csx', '16', '--validate_only']); "
            "status = open('/proc/self/status').read(); "
            "peak_kb = int(status.split('VmHWM:')[1].split()[0]); "
            "print(json.dumps({'rc': rc, 'peak_kb': peak_kb}))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                         text=True, check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""}).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rc"] == 0
    assert 100 * 1024 < result["peak_kb"] < 1024 * 1024  # torch alone is > 100 MB: a real reading


def test_training_what_cannot_fit_is_refused_with_the_estimate(capsys):
    assert cli.main(["run", "--params", str(MODELZOO / "params_llama2_7b_rigl80.yaml")]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "optimizer_state" in err and "6,738,415,616 parameters" in err


def test_missing_data_dir_is_an_error_before_any_worker(tmp_path, capsys):
    params = tmp_path / "proxy.yaml"
    params.write_text((MODELZOO / "params_gpt3_125m_rigl75.yaml").read_text())
    small = ["--set", "model.num_hidden_layers=1", "--set", "model.hidden_size=32", "--set", "model.num_heads=2",
             "--set", "model.filter_size=64", "--set", "model.vocab_size=256", "--set", "train_input.batch_size=4",
             "--set", "model.max_position_embeddings=32"]
    assert cli.main(["run", "--params", str(params), "--num_csx", "2", *small]) == 2
    assert "train_input.data_dir './language/datasets" in capsys.readouterr().err
