"""Kernel variants chosen per machine and shape (issue 46), and the CPU record they come with."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import simulator
from simulator import cpu
from simulator.crossover import VARIANT_PROBES, KernelCalibration, VariantTiming, calibrate
from simulator.native import ALL_VARIANTS, DEFAULT_VARIANT, KernelVariant, load_kernels

NAMES = [variant.name for variant in ALL_VARIANTS]


def timing(out_features: int, in_features: int, density: float,
           fast: dict[str, float]) -> VariantTiming:
    """A probe where the variants in `fast` took the given ms and every other one 3 ms."""
    return VariantTiming(out_features, in_features, density, 64,
                         tuple((name, fast.get(name, 3.0)) for name in NAMES))


def calibration(*timings: VariantTiming) -> KernelCalibration:
    """Costs under which CSR wins at any sparsity (no fixed cost, a non-zero as cheap as a
    dense multiply-add), with the given variant timings."""
    return KernelCalibration(0.0, 1e-10, 0.0, 1e-10, 0.0, "native", 1, timings, "test CPU")


def test_a_layer_runs_the_variant_fastest_on_the_probe_nearest_its_shape_and_density():
    cal = calibration(timing(512, 512, 0.1, {"native/fused/store/pf0": 1.0}),
                      timing(4096, 1024, 0.1, {"256/split/stream/pf0": 1.0}),
                      timing(1024, 1024, 0.03, {"native/split/store/pf0": 1.0}))
    assert cal.variant_for(600, 500, 0.12) == KernelVariant("native", "fused", False, 0)
    assert cal.variant_for(3000, 1024, 0.08) == KernelVariant("256", "split", True, 0)
    assert cal.variant_for(1024, 1024, 0.02) == KernelVariant("native", "split", False, 0)
    tie = calibration(timing(512, 512, 0.1, {"native/fused/store/pf0": 1.0,
                                             "256/fused/store/pf0": 1.0}))
    assert tie.variant_for(512, 512, 0.1).name == "native/fused/store/pf0"  # first timed of equals
    close = calibration(timing(512, 512, 0.1, {"native/split/stream/pf0": 1.0,
                                               "native/fused2/store/pf8": 0.96}))
    assert close.variant_for(512, 512, 0.1) == DEFAULT_VARIANT  # not 5% faster: the old kernels
    clear = calibration(timing(512, 512, 0.1, {"native/split/stream/pf0": 1.0,
                                               "native/fused2/store/pf8": 0.9}))
    assert clear.variant_for(512, 512, 0.1).name == "native/fused2/store/pf8"


@pytest.mark.skipif(load_kernels() is None, reason="the C kernels did not build")
def test_compiled_layers_run_their_shapes_variants_and_train_as_masked_dense():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64))
    reference = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64))
    reference.load_state_dict(model.state_dict())
    for layer in (model[0], model[2]):
        layer.register_buffer("weight_mask", torch.rand_like(layer.weight) < 0.5)
    masks = [model[0].weight_mask, model[2].weight_mask]
    cal = calibration(timing(16, 16, 0.5, {"native/fused/store/pf0": 1.0}),
                      timing(64, 16, 0.5, {"256/split/stream/pf0": 1.0}))
    forced = simulator.compile(copy.deepcopy(model), kernel="csr")  # nothing measured
    assert [d.variant for d in simulator.decisions(forced)] == [DEFAULT_VARIANT.name] * 2
    simulator.compile(model, calibration=cal, kernel="csr")  # a calibration picks the variants
    decisions = simulator.decisions(model)
    assert [d.kernel for d in decisions] == ["csr", "csr"]
    assert [d.variant for d in decisions] == ["native/fused/store/pf0", "256/split/stream/pf0"]
    x = torch.randn(70, 16)
    y = model(x)
    y_ref = F.linear(torch.relu(F.linear(x, reference[0].weight * masks[0], reference[0].bias)),
                     reference[2].weight * masks[1], reference[2].bias)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for layer, ref, mask in zip((model[0], model[2]), (reference[0], reference[2]), masks):
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad * mask, rtol=1e-4,
                                   atol=1e-4)
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-4)


def test_replicas_averaging_their_timings_choose_the_same_variants():
    """Each rank of a job brings its machine's timings; averaged (the job's all-reduce), every
    rank holds the same calibration, the same choices, and the file written survives JSON."""
    first = calibration(timing(512, 512, 0.1, {"native/fused/store/pf0": 1.0}))
    second = calibration(timing(512, 512, 0.1, {"native/split/stream/pf0": 2.0}))
    assert first.variant_for(512, 512, 0.1) != second.variant_for(512, 512, 0.1)
    averaged = [(a + b) / 2 for a, b in zip(first.measurements(), second.measurements())]
    agreed = [cal.with_measurements(averaged) for cal in (first, second)]
    assert agreed[0] == agreed[1]
    assert agreed[0].variant_for(512, 512, 0.1).name == "native/fused/store/pf0"  # 2.0 vs 2.5 ms
    assert agreed[0].measurements() == averaged
    assert KernelCalibration(**json.loads(json.dumps(asdict(agreed[0])))) == agreed[0]


def test_a_calibration_file_from_before_the_variants_runs_the_old_kernels():
    old = {"dense_call_s": 1e-5, "dense_s_per_mac": 1e-11, "csr_call_s": 2e-5,
           "csr_s_per_nnz": 2e-11, "csr_s_per_feature": 1e-9, "backend": "native", "threads": 1}
    assert KernelCalibration(**old).variant_for(1024, 1024, 0.1) == DEFAULT_VARIANT


def test_variant_names_round_trip_and_bad_ones_are_rejected_by_name():
    assert [KernelVariant.from_name(name) for name in NAMES] == list(ALL_VARIANTS)
    assert DEFAULT_VARIANT.name == "native/split/stream/pf0"
    with pytest.raises(ValueError, match="backward"):
        KernelVariant(backward="merged")
    with pytest.raises(ValueError, match="vector"):
        KernelVariant(vector="128")
    with pytest.raises(ValueError, match="prefetch"):
        KernelVariant(backward="fused", prefetch=3)
    with pytest.raises(ValueError, match="split one has none"):
        KernelVariant(backward="split", prefetch=8)
    with pytest.raises(ValueError, match="kernel variant"):
        KernelVariant.from_name("native/fused/store")


@pytest.mark.skipif(load_kernels() is None, reason="the C kernels did not build")
def test_a_measured_calibration_times_every_variant_on_every_probe():
    cal = calibrate()
    assert [(t.out_features, t.in_features, t.density) for t in cal.variant_timings] == \
        list(VARIANT_PROBES)
    assert all([name for name, _ in t.ms] == NAMES and min(ms for _, ms in t.ms) > 0
               for t in cal.variant_timings)
    assert cal.cpu == cpu.summary()


def test_the_cpu_record_names_model_flags_caches_and_cores():
    record = cpu.describe()
    assert record["model"] == cpu.cpu_model() != ""
    assert set(record["flags"]) <= set(cpu.FLAGS_THAT_MATTER)
    assert set(record["flags"]) == set(cpu.FLAGS_THAT_MATTER) & set(cpu.cpu_flags())
    assert record["topology"]["logical_cpus"] >= record["topology"]["usable_cpus"] >= 1
    levels = [c["level"] for c in record["caches"]]
    assert levels == sorted(levels)
    assert cpu.summary(record).startswith(record["model"])
    assert json.loads(json.dumps(record)) == record  # goes into every result file as it is


@pytest.mark.parametrize(("cpu_list", "count"), [("0", 1), ("0-3", 4), ("0-3,8", 5),
                                                 ("0,2,4-5", 4)])
def test_shared_cpu_lists_are_counted(cpu_list, count):
    assert cpu._count_cpus(cpu_list) == count


def test_a_layer_that_stays_dense_measures_nothing(monkeypatch):
    """A full mask (or a CUDA weight) runs masked dense: no calibration, and so no variant, is
    measured for it."""
    from simulator import layers

    def measure(*args):
        raise AssertionError("measured a calibration for a layer that stays dense")
    monkeypatch.setattr(layers, "machine_calibration", measure)
    model = nn.Sequential(nn.Linear(8, 8))
    model[0].register_buffer("weight_mask", torch.ones(8, 8, dtype=torch.bool))
    simulator.compile(model)
    [decision] = simulator.decisions(model)
    assert decision.kernel == "dense" and decision.variant == DEFAULT_VARIANT.name
