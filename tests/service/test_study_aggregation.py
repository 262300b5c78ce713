"""Multi-seed studies: one job per (variant, seed), mean ± sd per variant, gaps against seed noise."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from service.local_stack import format_comparison
from service.schemas import StudyCreate, StudyReportRow
from service.studies import aggregate, study_jobs, variant_spec

STUDY_YAML = Path(__file__).resolve().parents[2] / "examples" / "study.yaml"


def _row(variant: str, seed: int, ppl: float | None, speedup: float | None = 1.0) -> StudyReportRow:
    return StudyReportRow(job_id=0, variant=variant, status="SUCCEEDED" if ppl else "FAILED",
                          final_eval_perplexity=ppl, best_eval_perplexity=ppl,
                          projected_speedup=speedup, wall_time_s=1.0, seed=seed)


def _study(**extra: object) -> StudyCreate:
    from service.api.body import nest_params

    body = yaml.safe_load(STUDY_YAML.read_text(encoding="utf-8")) | extra
    return StudyCreate.model_validate(nest_params(body, StudyCreate))


PPL = {"static": [6.97, 6.91, 6.83], "set": [6.69, 6.74, 6.70], "rigl": [6.60, 6.75, 6.71]}


def test_aggregate_mean_sd_and_gaps_against_seed_noise():
    rows = [_row(v, seed, p) for v, values in PPL.items() for seed, p in enumerate(values)]
    rows.append(_row("rigl", 3, None))  # a failed seed counts in no statistic
    summaries, gaps = aggregate(rows)
    by_name = {s.variant: s for s in summaries}
    assert list(by_name) == ["static", "set", "rigl"]
    for name, values in PPL.items():
        assert by_name[name].runs == 3
        assert by_name[name].final_eval_perplexity_mean == pytest.approx(statistics.fmean(values))
        assert by_name[name].final_eval_perplexity_sd == pytest.approx(statistics.stdev(values))
    pairs = {(g.better, g.worse): g for g in gaps}
    assert set(pairs) == {("set", "static"), ("rigl", "static"), ("rigl", "set")}
    # set vs static: gap 0.193 > larger sd 0.070 -> real, in the published order
    assert pairs["set", "static"].gap == pytest.approx(statistics.fmean(PPL["static"])
                                                       - statistics.fmean(PPL["set"]))
    assert pairs["set", "static"].exceeds_noise and pairs["set", "static"].published == "agrees"
    # rigl vs set: gap 0.023 < rigl's sd 0.078 -> within noise; the published order holds
    assert pairs["rigl", "set"].noise == pytest.approx(statistics.stdev(PPL["rigl"]))
    assert not pairs["rigl", "set"].exceeds_noise and pairs["rigl", "set"].published == "agrees"


def test_aggregate_flags_a_reversed_published_pair_and_needs_two_runs_for_noise():
    rows = [_row("rigl", s, p) for s, p in enumerate([7.02, 7.01, 7.14])]
    rows += [_row("static", s, p) for s, p in enumerate([6.97, 6.91, 6.83])]
    rows.append(_row("dense", 0, 6.0))
    summaries, gaps = aggregate(rows)
    pairs = {(g.better, g.worse): g for g in gaps}
    assert pairs["static", "rigl"].published == "disagrees"  # published: RigL < SET < Static
    assert pairs["static", "rigl"].exceeds_noise
    dense = next(s for s in summaries if s.variant == "dense")
    assert dense.runs == 1 and dense.final_eval_perplexity_sd is None
    # one dense run: no noise estimate, and the report says so rather than "within noise"
    assert pairs["dense", "static"].noise is None and pairs["dense", "static"].exceeds_noise is None
    assert pairs["dense", "static"].verdict == "1 seed: no noise estimate"
    assert pairs["static", "rigl"].verdict == "real"
    assert pairs["dense", "rigl"].published == "agrees"
    assert pairs["dense", "static"].published == "agrees"  # implied: dense < RigL < SET < Static


def test_aggregate_of_nothing_measured():
    summaries, gaps = aggregate([_row("rigl", 0, None, None)])
    assert summaries[0].runs == 0 and summaries[0].final_eval_perplexity_mean is None
    assert summaries[0].projected_speedup_mean is None and gaps == []


def test_seeds_make_one_job_per_variant_and_seed():
    study = _study(seeds=[3, 5])
    jobs = study_jobs(study)
    variants = [job.variant for job in jobs]
    assert len(jobs) == 2 * len(study.algorithms)
    assert [job.seed for job in jobs] == [3] * len(study.algorithms) + [5] * len(study.algorithms)
    assert variants[:len(study.algorithms)] == list(study.algorithms)
    last = jobs[-1]
    assert variant_spec(study.params, last.sparsity, last.seed).runconfig.seed == 5
    assert [job.seed for job in study_jobs(_study())] == [None] * len(study.algorithms)


@pytest.mark.parametrize("seeds", [[0, 0], [-1], [], [2**31]])
def test_bad_seeds_are_refused_naming_the_field(seeds: list[int]):
    with pytest.raises(ValidationError, match="seeds"):
        _study(seeds=seeds)


def test_printed_comparison_has_mean_sd_gaps_and_explains_flat_speedups():
    rows = [_row(v, seed, p) for v, values in PPL.items() for seed, p in enumerate(values)]
    summaries, gaps = aggregate(rows)
    report = {"rows": [r.model_dump() for r in rows],
              "variants": [s.model_dump() for s in summaries],
              "gaps": [g.model_dump() for g in gaps], "full_size": []}
    text = format_comparison(report)
    assert f"static     {statistics.fmean(PPL['static']):.3f} ± " \
           f"{statistics.stdev(PPL['static']):.3f}  (3 runs)" in text
    assert "set < static: +0.193 vs sd 0.070 -> real, agrees with the published order" in text
    assert "rigl < set: +0.023 vs sd 0.078 -> within seed noise" in text
    assert "sparsity cannot show" in text  # every speed-up is 1.00x: say why
    one_seed = {"rows": [r.model_dump() for r in rows[:1]],
                "variants": [{**summaries[0].model_dump(), "runs": 1}], "gaps": []}
    one_seed["rows"][0]["projected_speedup"] = 2.3
    assert format_comparison(one_seed) == ""


def test_full_size_projection_carries_trained_densities_by_layer_role():
    from simulator.cost_model import LayerShape, WaferScaleCluster, project_step

    from service.full_size import full_size_projection

    def block(i: int, width: int) -> list[LayerShape]:
        return [LayerShape(f"layers.{i}.attn.proj_q.weight", width, width),
                LayerShape(f"layers.{i}.attn.scores", 2 * 2048, width, streams_weights=False),
                LayerShape(f"layers.{i}.ffn.fc1.weight", 4 * width, width),
                LayerShape(f"layers.{i}.ffn.fc2.weight", width, 4 * width)]

    full = [layer for i in range(24) for layer in block(i, 2048)]
    full.append(LayerShape("lm_head.weight", 50257, 2048))
    # the proxy: 2 blocks; RigL uniform at 80%; GraNet's blocks ended at 70% and 90% in fc1
    trained = {"dense": {},
               "rigl": {f"layers.{i}.{n}.weight": 0.2 for i in range(2)
                        for n in ("attn.proj_q", "ffn.fc1", "ffn.fc2")},
               "granet": {"layers.0.ffn.fc1.weight": 0.3, "layers.1.ffn.fc1.weight": 0.1}}
    tokens = 512 * 2048
    rows = full_size_projection(trained, full, tokens, "GPT-3 XL", systems=(1, 4))
    cell = {(r.variant, r.num_csx): r for r in rows}
    assert {r.model for r in rows} == {"GPT-3 XL"} and len(rows) == 6
    assert cell["dense", 1].speedup_vs_dense == pytest.approx(1.0)
    expected = [LayerShape(l.name, l.out_features, l.in_features,
                           0.2 if l.streams_weights and "lm_head" not in l.name else 1.0,
                           streams_weights=l.streams_weights) for l in full]
    for n in (1, 4):
        step = project_step(expected, tokens, WaferScaleCluster(num_csx=n))
        assert cell["rigl", n].step_ms == pytest.approx(step.step_ms)
        assert cell["rigl", n].speedup_vs_dense == pytest.approx(step.speedup_vs_dense)
    assert cell["rigl", 1].speedup_vs_dense > 1.5  # compute-bound at this size: sparsity shows
    # GraNet: every fc1 at the mean 0.2 of its proxy's fc1 layers; everything else dense
    granet = [LayerShape(l.name, l.out_features, l.in_features, 0.2 if "fc1" in l.name else 1.0,
                         streams_weights=l.streams_weights) for l in full]
    assert cell["granet", 1].step_ms == pytest.approx(
        project_step(granet, tokens, WaferScaleCluster(num_csx=1)).step_ms)
    assert 1.0 < cell["granet", 1].speedup_vs_dense < cell["rigl", 1].speedup_vs_dense


@pytest.mark.slow  # the study's parent run opens an MLflow store
def test_a_study_with_seeds_runs_each_variant_per_seed_and_reports_mean_sd(
        client, alice, launcher):
    from service_helpers import wait_status

    # a proxy: the full-size model (4 layers, hidden_size 1024, 256 x 1024 tokens per step)
    # trained at the tiny preset's size through `overrides`
    params = {"train_input": {"batch_size": 256, "max_sequence_length": 1024},
              "model": {"preset": "tiny", "hidden_size": 1024, "filter_size": 4096,
                        "num_hidden_layers": 4, "max_position_embeddings": 1024},
              "runconfig": {"max_steps": 8, "seed": 7}}
    overrides = ["model.hidden_size=64", "model.filter_size=160", "model.num_hidden_layers=2",
                 "train_input.batch_size=4", "train_input.max_sequence_length=16"]
    response = client.post("/v1/studies", json={
        "name": "seeded", "params": params, "algorithms": ["static", "rigl"], "sparsity": 0.8,
        "seeds": [0, 1], "overrides": overrides}, headers=alice)
    assert response.status_code == 201, response.text
    jobs = response.json()["jobs"]
    assert [(j["tags"]["csx.variant"], j["tags"]["csx.seed"]) for j in jobs] == [
        ("static", "0"), ("rigl", "0"), ("static", "1"), ("rigl", "1")]
    assert jobs[3]["name"] == "seeded/rigl/seed1"
    ppl = {"static": [7.0, 7.2], "rigl": [6.0, 6.1]}
    for job in (jobs[0], jobs[1], jobs[3]):  # static seed 1 still runs: the report covers
        # what has finished
        value = ppl[job["tags"]["csx.variant"]][int(job["tags"]["csx.seed"])]
        launcher.handle_for(job["id"]).finish({
            "final_eval_perplexity": value, "best_eval_perplexity": value,
            "eval_history": [{"step": 8, "loss": 1.9, "perplexity": value}],
            "layer_density": {f"transformer_decoder.layers.{i}.ffn.ffn.1.linear_layer.weight":
                              0.2 if job["tags"]["csx.variant"] == "rigl" else 0.5
                              for i in range(2)}})
        wait_status(client, alice, job["id"], "SUCCEEDED")
    report = client.get(f"/v1/studies/{response.json()['id']}/report", headers=alice).json()
    launcher.handle_for(jobs[2]["id"]).finish({})
    assert not report["complete"]
    summary = {v["variant"]: v for v in report["variants"]}
    assert summary["static"]["runs"] == 1 and summary["static"]["final_eval_perplexity_sd"] is None
    assert summary["rigl"]["final_eval_perplexity_mean"] == pytest.approx(6.05)
    assert summary["rigl"]["final_eval_perplexity_sd"] == pytest.approx(statistics.stdev([6.0, 6.1]))
    # one static seed so far: no noise estimate for the pair, and the report says so
    assert report["gaps"] == [{"better": "rigl", "worse": "static", "gap": pytest.approx(0.95),
                               "noise": None, "exceeds_noise": None,
                               "verdict": "1 seed: no noise estimate", "published": "agrees"}]
    full = {(p["variant"], p["num_csx"]): p for p in report["full_size"]}
    assert set(full) == {(v, n) for v in ("static", "rigl") for n in (1, 4, 16)}
    assert "4 layers, hidden_size 1024" in full["rigl", 1]["model"]
    # only the FFN-down layers were sparse in the proxy: denser static gains less than rigl
    assert 1.0 < full["static", 1]["speedup_vs_dense"] < full["rigl", 1]["speedup_vs_dense"]
    assert full["rigl", 16]["step_ms"] < full["rigl", 1]["step_ms"]


def test_algorithm_options_extend_the_derived_section_of_their_algorithm():
    study = _study(algorithm_options={"rigl": {"balance_out_groups": 32}})
    sections = {job.variant: job.sparsity for job in study_jobs(study)}
    assert sections["rigl"]["balance_out_groups"] == 32
    assert sections["rigl"]["update"] == sections["set"]["update"]  # the rest stays derived
    assert "balance_out_groups" not in sections["set"]
    trimmed = _study(algorithms=["dense", "rigl"])  # options of algorithms not run: unused
    assert [job.variant for job in study_jobs(trimmed)] == ["dense", "rigl"]
    for bad in ({"dense": {"x": 1}}, {"gmp": {"x": 1}}):
        with pytest.raises(ValidationError, match="algorithm_options"):
            _study(algorithm_options=bad)
