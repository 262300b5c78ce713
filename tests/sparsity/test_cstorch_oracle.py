"""The differential fixtures: each script of tools/cstorch_oracle/scripts, written as cstorch's
docs and ModelZoo write them, run here with its one import changed to ``sparsity.cstorch``,
records the same masks, hook calls, state dicts and steps as cerebras-pytorch 2.10 recorded
(tests/fixtures/cstorch_oracle, made by ``harness.py record`` in the reference's virtualenv),
and losses within float tolerance."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cstorch_oracle_harness", ROOT / "tools" / "cstorch_oracle" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def test_every_script_has_a_recorded_fixture_and_differs_from_ours_by_one_import_line():
    names = harness.script_names()
    assert {"custom_algorithm", "modelzoo_loop", "research_resume", "algorithms", "checkpoints",
            "lr_schedulers", "accumulation"} <= set(names)
    for name in names:
        assert (harness.FIXTURES / f"{name}.pt").is_file(), name
        reference, ours = harness.source_for(name, "reference"), harness.source_for(name, "ours")
        changed = [(a, b) for a, b in zip(reference.splitlines(), ours.splitlines()) if a != b]
        assert changed == [(harness.REFERENCE_IMPORT, harness.OURS_IMPORT)]


@pytest.mark.parametrize("name", sorted(set(harness.script_names()) - harness.DIFFERS_ON_PURPOSE))
def test_a_script_matches_the_reference_recording(name):
    expected = torch.load(harness.FIXTURES / f"{name}.pt", weights_only=True)
    actual = harness.run_isolated(name, "ours")
    assert harness.differences(expected, actual, name) == []


def test_the_comparison_catches_a_changed_mask_and_a_drifted_loss():
    mask = torch.tensor([True, False, True])
    recorded = {"masks": [{"w_mask": mask}], "loss": [1.0]}
    assert harness.differences(recorded, {"masks": [{"w_mask": mask.clone()}], "loss": [1.00001]}) == []
    flipped = {"masks": [{"w_mask": torch.tensor([True, True, False])}], "loss": [1.0]}
    assert harness.differences(recorded, flipped) == [".masks[0].w_mask: masks differ"]
    assert harness.differences(recorded, {"masks": [{"w_mask": mask}], "loss": [1.01]}) == [".loss[0]: 1.0 != 1.01"]


def test_the_fixtures_cover_every_algorithm_schedule_hook_and_checkpoint_load():
    algorithms = torch.load(harness.FIXTURES / "algorithms.pt", weights_only=True)
    cases = {key.split("/")[0] for key in algorithms}
    for family in ("static", "gmp_linear", "gmp_exp", "gmp_power", "gmp_cosine", "gmp_cycling", "set", "rigl",
                   "configured_group"):
        assert any(case.startswith(family) for case in cases), family
    assert all(algorithms[f"{case}/target"] and algorithms[f"{case}/actual"] for case in cases)
    checkpoints = torch.load(harness.FIXTURES / "checkpoints.pt", weights_only=True)
    for name, saved in checkpoints["saved_masks"][0].items():
        assert torch.equal(checkpoints["loaded_masks"][0][name], saved)  # the reference keeps loaded masks
    research = torch.load(harness.FIXTURES / "research_resume.pt", weights_only=True)
    assert research["skipped_steps"] == [1] and research["uninterrupted_step"] == [11]  # 12 steps, 1 skipped


def test_the_fuzz_fixture_holds_200_small_combinations_of_every_kind():
    path = harness.FIXTURES / "fuzz_combinations.pt"
    assert path.stat().st_size < 2_000_000
    recorded = torch.load(path, weights_only=True)
    specs = [values[0] for key, values in recorded.items() if key.endswith("/spec")]
    assert len(specs) >= 200
    seen = {field: {spec[field] for spec in specs} for field in
            ("algorithm", "choosing", "schedule", "cadence", "micro_batches", "optimizer")}
    assert seen["algorithm"] == {"static", "gmp", "set", "rigl", "magnitudeshuffle"}
    assert seen["choosing"] == {"whole_model", "glob", "glob_list", "default_filter", "callable", "two_groups"}
    assert {"staircase", "counted_cycling", "cycling", "cubic", "lambda"} <= seen["schedule"]
    assert {"every_step", "freq", "freq_start_stop", "steps", "user"} <= seen["cadence"]
    assert seen["micro_batches"] == {1, 2, 3} and len(seen["optimizer"]) == 4
    assert {len(spec["layers"]) for spec in specs} == {1, 2, 3, 4}
    # every combination recorded its steps: a mask fingerprint before training and after each step
    assert all(len(recorded[f"{spec['index']:03d}/masks"]) == 7 for spec in specs)


def test_the_deliberate_differences_are_exactly_the_documented_ones():
    expected = torch.load(harness.FIXTURES / "deliberate_differences.pt", weights_only=True)
    actual = harness.run_isolated("deliberate_differences", "ours")
    found = harness.differences(expected, actual, "")
    assert sorted({line.split("[")[0].split(".")[1] for line in found}) == [
        "cycling_loaded", "linear_dtype_after_amp_init", "lr_used", "muon_step", "restart_kept",
        "scheduler_step_after_scaled_step", "state_keys/Adadelta", "state_keys/RMSprop", "state_keys/Rprop",
        "submodule_masks_kept", "swapped_out"]
    # a cosine drop_fraction: the reference swaps ~the same count every step; ours follows the cosine
    assert actual["swapped_out"][0] == expected["swapped_out"][0]
    assert actual["swapped_out"] == sorted(actual["swapped_out"], reverse=True) and actual["swapped_out"][-1] == 0
    assert min(expected["swapped_out"][1:]) > actual["swapped_out"][1] > 0
    # the Cycling index survives load_state_dict here; the reference loads an empty schedule state
    assert actual["cycling_loaded"] == actual["cycling_saved"] == expected["cycling_saved"]
    assert expected["cycling_loaded"][0]["sparsity"] == {}
    # a 50% checkpoint mask under a 75% config: re-pruned here (100 of 400), kept by the reference
    assert expected["restart_kept"] == [200] and actual["restart_kept"] == [100]
    # masks loaded through a submodule's load_state_dict: redrawn by the reference's initialize(), kept here
    assert expected["submodule_masks_kept"] == [False] and actual["submodule_masks_kept"] == [True]
    # amp.init(): the reference computes every linear of the process in float16, CPU included; here float32
    assert expected["linear_dtype_after_amp_init"] == ["torch.float16"]
    assert actual["linear_dtype_after_amp_init"] == ["torch.float32"]
    # a skipped step (the second of five): the reference rolls the scheduler's last_epoch back but
    # keeps the learning rate it wrote, so the next step runs at the following value; here it holds
    assert expected["lr_used"] == pytest.approx([0.1, 0.09, 0.08, 0.08, 0.07])
    assert actual["lr_used"] == pytest.approx([0.1, 0.09, 0.09, 0.08, 0.07])
    assert actual["last_epoch"] == expected["last_epoch"] == [1, 1, 2, 3, 4]
    # off a CS system, the reference's scheduler.step() after a dynamically scaled step raises
    assert expected["scheduler_step_after_scaled_step"] == ["RuntimeError"]
    assert actual["scheduler_step_after_scaled_step"] == ["ok"]
    # Adadelta, RMSprop and Rprop compute with PyTorch's arithmetic, whose state also counts steps
    for name in ("Adadelta", "RMSprop", "Rprop"):
        assert actual[f"state_keys/{name}"][0] == sorted(expected[f"state_keys/{name}"][0] + ["step"])
    # the reference's Muon cannot step off a CS system (its Newton-Schulz helper takes no self)
    assert expected["muon_step"] == ["TypeError"] and actual["muon_step"] == ["ok"]
