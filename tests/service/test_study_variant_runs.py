"""A study variant's own batch size and step count (the Cerebras blog's protocol: sparse runs at
half the batch for twice the steps): same tokens as the base, a stretched learning-rate schedule,
and a 4xx naming the field when a variant cannot keep the tokens or split its batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from service.api.body import nest_params
from service.schemas import StudyCreate
from service.studies import study_jobs, variant_spec
from csx_config.schedulers import learning_rate_at

BLOG_YAML = Path(__file__).resolve().parents[2] / "examples" / "study_blog.yaml"
WARMUP_COSINE = [
    {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3, "total_iters": 10},
    {"scheduler": "CosineDecay", "initial_learning_rate": 1e-3, "end_learning_rate": 1e-4,
     "total_iters": 30}]


def _body(variants: list[dict[str, Any]], batch: int = 8, steps: int = 40, num_csx: int = 2,
          learning_rate: Any = None) -> dict[str, Any]:
    return {"name": "s", "variants": variants, "params": {
        "train_input": {"batch_size": batch, "max_sequence_length": 16},
        "model": {"preset": "tiny"},
        "optimizer": {"learning_rate": learning_rate or WARMUP_COSINE},
        "runconfig": {"max_steps": steps, "eval_frequency": 10, "checkpoint_steps": 20,
                      "log_steps": 5, "num_csx": num_csx}}}


def _specs(study: StudyCreate) -> dict[str, Any]:
    return {job.variant: variant_spec(study.params, job.sparsity, job.seed,
                                      batch_size=job.batch_size, max_steps=job.max_steps)
            for job in study_jobs(study)}


STATIC = {"algorithm": "static", "sparsity": 0.8}


def test_the_blog_study_gives_every_variant_the_same_tokens_and_sparse_runs_half_the_batch():
    body = yaml.safe_load(BLOG_YAML.read_text(encoding="utf-8"))
    study = StudyCreate.model_validate(nest_params(body, StudyCreate))
    specs = _specs(study)
    assert list(specs) == ["dense", "static", "set", "rigl", "rigl-sinkhorn", "granet"]
    dense = specs.pop("dense")
    tokens = dense.train_input.batch_size * dense.runconfig.max_steps
    for name, spec in specs.items():
        assert spec.train_input.batch_size * spec.runconfig.max_steps == tokens, name
        assert spec.train_input.batch_size * 2 == dense.train_input.batch_size, name
        assert spec.runconfig.eval_frequency == 2 * dense.runconfig.eval_frequency
        if name != "static":  # the blog's drop fraction, decayed to 0 at 75% of the run
            stop = int(0.75 * spec.runconfig.max_steps)
            assert spec.sparsity["drop_fraction"] == {"type": "cosine", "init": 0.5,
                                                      "half_period": stop}
            assert spec.sparsity["update"]["stop"] == stop
    assert specs["rigl-sinkhorn"].sparsity["grow_score_scaling"] == "sinkhorn"
    assert "grow_score_scaling" not in specs["rigl"].sparsity  # RigL as published


@settings(max_examples=60)
@given(base_batch=st.integers(1, 64), base_steps=st.integers(1, 500), batch=st.integers(1, 64),
       num_csx=st.integers(1, 4))
def test_a_variant_batch_alone_derives_its_steps_or_is_refused_naming_the_field(
        base_batch: int, base_steps: int, batch: int, num_csx: int):
    body = _body([{"name": "v", "sparsity": STATIC, "batch_size": batch}], batch=base_batch,
                 steps=base_steps, num_csx=num_csx)
    tokens = base_batch * base_steps
    if base_batch % num_csx:
        return  # the base itself is refused at submission (service.jobs), not our concern here
    if tokens % batch or batch % num_csx:
        with pytest.raises(ValidationError, match=r"variants\[0\] \(v\)\.batch_size"):
            StudyCreate.model_validate(body)
        return
    variant = StudyCreate.model_validate(body).variants[0]
    assert variant.batch_size * variant.max_steps == tokens
    assert variant.batch_size == batch


@settings(max_examples=40)
@given(ratio=st.sampled_from([2, 3, 4]), step=st.integers(0, 60))
def test_a_longer_variant_follows_the_same_learning_rate_curve_over_the_tokens(ratio: int,
                                                                               step: int):
    body = _body([{"name": "dense", "sparsity": None},
                  {"name": "long", "sparsity": STATIC, "max_steps": 40 * ratio}], batch=24)
    specs = _specs(StudyCreate.model_validate(body))
    assert specs["long"].train_input.batch_size == 24 // ratio  # derived: same tokens
    dense, long = specs["dense"].optimizer.learning_rate, specs["long"].optimizer.learning_rate
    assert learning_rate_at(long, step * ratio) == pytest.approx(learning_rate_at(dense, step))
    assert [s.total_iters for s in long] == [10 * ratio, 30 * ratio]
    run = specs["long"].runconfig
    assert (run.eval_frequency, run.checkpoint_steps, run.log_steps) == (10 * ratio, 20 * ratio,
                                                                         5 * ratio)


def test_a_constant_rate_and_a_variant_without_overrides_are_left_as_they_are():
    body = _body([{"name": "same", "sparsity": STATIC},
                  {"name": "long", "sparsity": STATIC, "batch_size": 4, "max_steps": 80}],
                 learning_rate=2e-3)
    study = StudyCreate.model_validate(body)
    specs = _specs(study)
    assert study.variants[0].batch_size is None and study.variants[0].max_steps is None
    assert specs["same"].model_dump() == variant_spec(study.params, STATIC).model_dump()
    assert specs["long"].optimizer.learning_rate == 2e-3
    assert (specs["long"].train_input.batch_size, specs["long"].runconfig.max_steps) == (4, 80)


@pytest.mark.parametrize(("override", "words"), [
    ({"batch_size": 4, "max_steps": 60}, r"variants\[1\] \(sparse\)\.batch_size: batch_size 4 x "
                                         r"max_steps 60 must equal the base's 8 x 40 = 320"),
    ({"max_steps": 33}, r"variants\[1\] \(sparse\)\.max_steps"),
    ({"batch_size": 5}, r"variants\[1\] \(sparse\)\.batch_size"),  # 320 / 5 = 64 steps, 5 % 2
    ({"batch_size": 0}, "batch_size"),
    ({"max_steps": -2}, "max_steps"),
])
def test_a_variant_that_breaks_the_token_budget_or_the_split_is_refused(override: dict,
                                                                        words: str):
    body = _body([{"name": "dense", "sparsity": None}, {"name": "sparse", "sparsity": STATIC,
                                                        **override}])
    with pytest.raises(ValidationError, match=words):
        StudyCreate.model_validate(body)


def test_the_num_csx_option_decides_the_split(client: TestClient, alice: dict[str, str]):
    body = _body([{"name": "sparse", "sparsity": STATIC, "batch_size": 2}], num_csx=1)
    response = client.post("/v1/studies", json={**body, "num_csx": 4}, headers=alice)
    assert response.status_code == 422, response.text
    message = response.json()["detail"][0]["msg"]
    assert "variants[0] (sparse).batch_size" in message and "num_csx (4)" in message


def test_the_service_submits_each_variant_with_its_own_batch_and_steps(client: TestClient,
                                                                      alice: dict[str, str]):
    client.app.state.settings.paused = True  # the jobs are only looked at, never started
    body = _body([{"name": "dense", "sparsity": None},
                  {"name": "sparse", "sparsity": STATIC, "batch_size": 4}])
    response = client.post("/v1/studies", json={**body, "seeds": [0, 1]}, headers=alice)
    assert response.status_code == 201, response.text
    jobs = {(j["tags"]["csx.variant"], j["tags"]["csx.seed"]): j["id"]
            for j in response.json()["jobs"]}
    assert len(jobs) == 4
    for (variant, seed), job_id in jobs.items():
        params = client.get(f"/v1/jobs/{job_id}", headers=alice).json()["params"]
        expected = (8, 40) if variant == "dense" else (4, 80)
        assert (params["train_input"]["batch_size"], params["runconfig"]["max_steps"]) == expected
        assert params["runconfig"]["seed"] == int(seed)
