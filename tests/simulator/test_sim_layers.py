"""compile(): CSR layers on a live model, sharing Parameters and following mask updates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import simulator
import sparsity
from simulator.crossover import (
    PROBE_DENSITIES,
    PROBE_FEATURES,
    PROBE_TOKENS,
    TINY_FEATURES,
    TINY_TOKENS,
    KernelCalibration,
    calibrate,
    fit,
)
from simulator.csr import CSRStructure
from simulator.layers import CSRLinear, changed_row_count


class FakeAlgorithm:
    """The one method the simulator needs from a sparsity algorithm."""

    def __init__(self, dense: bool = False) -> None:
        self.dense = dense

    def needs_dense_grad(self) -> bool:
        return self.dense


def masked_mlp(density: float = 0.3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 6), nn.LayerNorm(6))
    for layer in (model[0], model[2]):
        mask = torch.rand_like(layer.weight) < density
        layer.register_buffer("weight_mask", mask)
        with torch.no_grad():
            layer.weight.mul_(mask)
    return model


def test_compile_shares_parameters_buffers_and_state_dict_keys():
    model = masked_mlp()
    params = {name: p for name, p in model.named_parameters()}
    mask = model[0].weight_mask
    keys = list(model.state_dict())
    simulator.compile(model, FakeAlgorithm(), kernel="csr")
    assert isinstance(model[0], CSRLinear) and isinstance(model[2], CSRLinear)
    assert isinstance(model[3], nn.LayerNorm)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert model[0].weight_mask is mask
    assert list(model.state_dict()) == keys


def test_mask_update_in_place_rebuilds_and_stays_exact():
    model = masked_mlp()
    reference = masked_mlp()
    simulator.compile(model, kernel="csr")
    x = torch.randn(5, 12)
    new_mask = torch.rand(20, 12) < 0.5
    for m in (model, reference):
        m[0].weight_mask.copy_(new_mask)
        with torch.no_grad():
            m[0].weight.copy_(torch.arange(240.0).view(20, 12) / 240 * new_mask)
    y = model(x)
    y_ref = reference(x)
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    decision = simulator.decisions(model)[0]
    assert decision.rebuilds == 2 and decision.density == pytest.approx(new_mask.float().mean())
    assert decision.name == "0" and decision.shape == (20, 12)


def test_dense_grad_follows_the_algorithm():
    algorithm = FakeAlgorithm(dense=False)
    model = simulator.compile(masked_mlp(), algorithm, kernel="csr")
    x = torch.randn(7, 12)
    model(x).sum().backward()
    mask = model[0].weight_mask
    assert not model[0].weight.grad[~mask].any()
    model.zero_grad()
    algorithm.dense = True
    model(x).sum().backward()
    assert model[0].weight.grad[~mask].abs().sum() > 0


# Costs shaped like this machine's (seconds): CSR 5x dearer per multiply-add than dense GEMM,
# plus a packing cost per activation element and a larger fixed cost per call.
FIXED_CALIBRATION = KernelCalibration(dense_call_s=2e-5, dense_s_per_mac=5e-11,
                                      csr_call_s=1e-4, csr_s_per_nnz=2.5e-10,
                                      csr_s_per_feature=2e-9, backend="native", threads=1)


def test_auto_rule_keeps_small_or_full_layers_dense_and_sparse_big_ones_csr():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1024), nn.Linear(1024, 1024),
                          nn.Linear(1024, 1024))
    for layer, density in zip(model, (0.5, 1.0, 0.05, 0.5)):
        layer.register_buffer("weight_mask", torch.rand_like(layer.weight) < density)
    model[1].weight_mask.fill_(True)
    simulator.compile(model, tokens=1024, calibration=FIXED_CALIBRATION)
    tiny, full, sparse, half = simulator.decisions(model)
    assert tiny.kernel == "dense" and "predicted" in tiny.why
    assert full.kernel == "dense" and "every weight" in full.why
    assert sparse.kernel == "csr" and "crossover density 0.1" in sparse.why
    assert half.kernel == "dense"


def test_a_mask_update_re_runs_the_rule():
    model = nn.Sequential(nn.Linear(1024, 1024))
    model[0].register_buffer("weight_mask", torch.rand(1024, 1024) < 0.5)
    simulator.compile(model, tokens=1024, calibration=FIXED_CALIBRATION)
    assert simulator.decisions(model)[0].kernel == "dense"
    model[0].weight_mask.copy_(torch.rand(1024, 1024) < 0.02)
    model(torch.randn(1024, 1024))
    decision = simulator.decisions(model)[0]
    assert decision.kernel == "csr" and decision.rebuilds == 1 and decision.tokens == 1024
    assert decision.changed_rows == 1024  # the dense layer had no structure to compare with


def test_rewriting_the_same_mask_keeps_the_structure():
    model = simulator.compile(masked_mlp(), kernel="csr")
    layer = model[0]
    structure = layer._structure
    layer.weight_mask.copy_(layer.weight_mask.clone())  # a write (version bump), same content
    x = torch.randn(5, 12)
    y = model(x)
    decision = simulator.decisions(model)[0]
    assert layer._structure is structure and decision.rebuilds == 1
    assert decision.changed_rows == 0 and decision.last_rebuild_ms == 0.0
    mask = layer.weight_mask
    row = int(mask.any(1).nonzero()[0])
    col = int(mask[row].nonzero()[0])
    mask[row, col] = False  # one row changes: rebuilt, and exact again
    with torch.no_grad():
        layer.weight[row, col] = 0
    reference = nn.functional.linear(nn.functional.relu(nn.functional.linear(
        x, model[0].weight * model[0].weight_mask, model[0].bias)),
        model[2].weight * model[2].weight_mask, model[2].bias)
    assert torch.allclose(model[:3](x), reference, rtol=1e-5, atol=1e-6)
    decision = simulator.decisions(model)[0]
    assert layer._structure is not structure and decision.rebuilds == 2
    assert decision.changed_rows == 1 and not torch.equal(y, model(x))


@settings(max_examples=60)
@given(rows=st.integers(1, 9), cols=st.integers(1, 9), seed=st.integers(0, 2**16),
       flips=st.integers(0, 6))
def test_changed_row_count_matches_a_row_by_row_comparison(rows, cols, seed, flips):
    gen = torch.Generator().manual_seed(seed)
    old = torch.rand(rows, cols, generator=gen) < 0.4
    new = old.clone()
    for _ in range(flips):  # a few flips, so unchanged rows are common too
        r, c = (int(torch.randint(n, (1,), generator=gen)) for n in (rows, cols))
        new[r, c] = ~new[r, c]
    expected = int((old != new).any(1).sum())
    assert changed_row_count(CSRStructure.from_mask(old), new, new.sum(1)) == expected


@given(dense_call=st.floats(1e-6, 1e-4), s_mac=st.floats(1e-11, 1e-9), csr_call=st.floats(1e-6, 1e-4),
       nnz_per_mac=st.floats(1.0, 10.0), s_feature=st.floats(1e-11, 1e-9))
def test_the_fit_recovers_the_costs_that_produced_the_probe_times(dense_call, s_mac, csr_call,
                                                                  nnz_per_mac, s_feature):
    """Probe times generated from known costs (the model the module docstring states) are fitted
    back to those costs; a real calibration's costs are timing-dependent, so only their signs
    are checked below."""
    truth = KernelCalibration(dense_call, s_mac, csr_call, s_mac * nnz_per_mac, s_feature, "native", 1)
    f, t, tf, tt = PROBE_FEATURES, PROBE_TOKENS, TINY_FEATURES, TINY_TOKENS
    high, low = PROBE_DENSITIES
    times = {"dense_big": truth.predict_dense_s(f, f, t), "dense_tiny": truth.predict_dense_s(tf, tf, tt),
             "csr_high": truth.predict_csr_s(f, f, f * f * high, t),
             "csr_low": truth.predict_csr_s(f, f, f * f * low, t),
             "csr_tiny": truth.predict_csr_s(tf, tf, tf * tf * 0.5, tt)}
    fitted = fit(times, "native", 1)
    for name in ("dense_call_s", "dense_s_per_mac", "csr_call_s", "csr_s_per_nnz", "csr_s_per_feature"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name


def test_a_disturbed_timing_never_makes_csr_cheaper_per_nonzero_than_dense_per_mac():
    times = {"dense_big": 1e-2, "dense_tiny": 1e-5, "csr_high": 1e-3, "csr_low": 2e-3, "csr_tiny": 1e-5}
    fitted = fit(times, "native", 1)  # csr_high faster than csr_low: a disturbed run
    assert fitted.csr_s_per_nnz >= fitted.dense_s_per_mac > 0


def test_a_measured_calibration_has_non_negative_costs():
    cal = calibrate()
    assert cal.dense_s_per_mac > 0 and cal.csr_s_per_nnz >= cal.dense_s_per_mac
    assert min(cal.dense_call_s, cal.csr_call_s, cal.csr_s_per_feature) >= 0


def test_forced_dense_matches_the_plain_module():
    model = masked_mlp()
    reference = masked_mlp()
    simulator.compile(model, kernel="dense")
    x = torch.randn(3, 12)
    assert torch.equal(model(x), reference(x))
    assert all(d.kernel == "dense" for d in simulator.decisions(model))


def test_compile_rejects_bad_arguments():
    with pytest.raises(TypeError, match="needs_dense_grad"):
        simulator.compile(masked_mlp(), algorithm=object())
    with pytest.raises(ValueError, match="kernel"):
        simulator.compile(masked_mlp(), kernel="fast")
    with pytest.raises(ValueError, match="tokens"):
        simulator.compile(masked_mlp(), tokens=0)


def test_autocast_runs_the_csr_layers_in_parameter_precision():
    model = masked_mlp()
    reference = masked_mlp()
    simulator.compile(model, kernel="csr")
    x = torch.randn(4, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        y_ref = reference(x)
    assert torch.allclose(y.float(), y_ref.float(), atol=5e-2)
    y.float().sum().backward()
    assert model[0].weight.grad is not None


def test_a_bare_masked_linear_compiles_to_a_csr_layer():
    layer = masked_mlp()[0]
    compiled = simulator.compile(layer, kernel="csr")
    assert isinstance(compiled, CSRLinear) and compiled.weight is layer.weight


def _train_rigl(fabric: bool, steps: int = 50):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8))
    algorithm = sparsity.RigL(sparsity=0.8, update={"freq": 5, "stop": 40}, drop_fraction=0.3,
                              seed=0)
    algorithm.apply(model)
    if fabric:
        simulator.compile(model, algorithm, kernel="csr")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    algorithm.apply(optimizer)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(24, 16, generator=gen), torch.randn(24, 8, generator=gen)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    masks = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_mask")}
    return losses, masks, model


def test_fifty_rigl_steps_through_the_fabric_match_masked_dense():
    dense_losses, dense_masks, _ = _train_rigl(fabric=False)
    csr_losses, csr_masks, model = _train_rigl(fabric=True)
    assert max(abs(a - b) for a, b in zip(dense_losses, csr_losses)) < 1e-4
    assert dense_masks.keys() == csr_masks.keys() and len(csr_masks) == 3
    assert all(torch.equal(dense_masks[k], csr_masks[k]) for k in dense_masks)
    assert all(d.rebuilds > 1 for d in simulator.decisions(model))  # masks did change


MEASURE = ("import json, sys; from dataclasses import asdict; import torch; "
           "torch.set_num_threads(1); from simulator.crossover import machine_calibration; "
           "print(json.dumps(asdict(machine_calibration())))")


def _measure_in_processes(folder, count: int) -> list[str]:
    """machine_calibration() in `count` fresh processes started together (each would measure
    different costs on its own: timing)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CSX_KERNEL_CACHE": str(folder)}
    procs = [subprocess.Popen([sys.executable, "-c", MEASURE], env=env, text=True,
                              stdout=subprocess.PIPE) for _ in range(count)]
    return [proc.communicate(timeout=300)[0] for proc in procs]


def test_every_process_on_a_machine_uses_the_first_ones_measurement(tmp_path):
    """The kernel choice (CSR and dense round differently) must not change from run to run:
    processes started together wait for one measurement, and later ones read it."""
    import json

    together = _measure_in_processes(tmp_path, 2)
    assert together[0] == together[1] != ""
    [saved] = tmp_path.glob("kernel_calibration-*1t-float32-*.json")
    # what a later process reads first
    assert json.loads(saved.read_text()) == json.loads(together[0])
    assert KernelCalibration(**json.loads(saved.read_text())).threads == 1


def test_a_damaged_or_unwritable_cache_still_gives_a_measurement(tmp_path, monkeypatch):
    import json

    from simulator import crossover

    monkeypatch.setenv("CSX_KERNEL_CACHE", str(tmp_path))
    first = crossover.machine_calibration()
    [saved] = tmp_path.glob("kernel_calibration-*.json")
    assert crossover.machine_calibration() == first  # read once per process
    saved.write_text("{not json", encoding="utf-8")
    crossover._machine_calibration.cache_clear()  # as a new process would find it
    assert crossover.machine_calibration() == first  # measured again (calibrate: per process)
    assert KernelCalibration(**json.loads(saved.read_text())) == first  # and written back
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv("CSX_KERNEL_CACHE", str(blocker))  # not a folder: nothing is written
    assert crossover.machine_calibration() == first
