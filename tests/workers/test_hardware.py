"""Each simulated system's hardware from the Ray cluster's nodes (workers/hardware.py), the
precision keys on CPU and CUDA (training/precision.py), and the service's capacity reader."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.cluster import LiveCluster
from workers import hardware
from workers.hardware import (
    GPU_MEMORY_RESOURCE,
    ClusterSummary,
    Node,
    SystemHardware,
    intra_op_threads,
    job_footprint,
    machine_resources,
    nodes_from_ray,
    per_system_hardware,
    summarise,
    systems_that_fit,
    usable_cores,
)
from training.precision import resolve_precision
from training.plan import plan_job

TWO_CORES = [Node("10.0.0.1", systems=2, cpus=2, gpus=0, memory_bytes=8 * 2**30)]


def resolve(nodes, num_csx, **keys):
    return per_system_hardware(nodes, num_csx, **keys)


def test_one_system_gets_every_core_and_two_get_one_each():
    assert resolve(TWO_CORES, 1) == SystemHardware(cpus=2, gpus=0)
    assert resolve(TWO_CORES, 2) == SystemHardware(cpus=1, gpus=0)
    assert resolve(TWO_CORES, 1, cpus_per_csx=1).cpus == 1


def test_one_gpu_per_system_where_the_cluster_has_them():
    gpu_node = [Node("a", systems=2, cpus=16, gpus=2, memory_bytes=2**36)]
    hardware = resolve(gpu_node, 2)
    assert (hardware.cpus, hardware.gpus, hardware.device) == (8, 1, "cuda")
    assert hardware.bundle() == {"CPU": 8.0, "csx": 1.0, "GPU": 1.0}
    assert resolve(gpu_node, 2, gpus_per_csx=0).bundle() == {"CPU": 8.0, "csx": 1.0}
    assert resolve([Node("a", 2, 16, 1, 2**36)], 2).gpus == 0  # one GPU for two systems: CPU


def test_two_single_core_nodes_hold_one_system_each():
    nodes = [Node("a", 1, 1, 0, 2**33), Node("b", 1, 1, 0, 2**33)]
    assert resolve(nodes, 2) == SystemHardware(cpus=1, gpus=0)
    with pytest.raises(ValueError, match="runconfig.cpus_per_csx=2 .* cannot place 2"):
        resolve(nodes, 2, cpus_per_csx=2)


def test_more_systems_than_declared_is_refused_naming_the_resource():
    with pytest.raises(ValueError, match=r"num_csx=3 needs 3 .* declares 2 \(resource 'csx'"):
        resolve(TWO_CORES, 3)
    with pytest.raises(ValueError, match="declares 0"):
        resolve([Node("a", 0, 64, 0, 2**36)], 1)


def test_ray_node_records_skip_dead_nodes_and_summarise_per_system():
    records = [
        {"Alive": True, "NodeManagerAddress": "a",
         "Resources": {"CPU": 8.0, "GPU": 2.0, "memory": 32 * 2**30, "csx": 2.0}},
        {"Alive": True, "NodeManagerAddress": "b",
         "Resources": {"CPU": 2.0, "memory": 4 * 2**30, "csx": 1.0}},
        {"Alive": False, "NodeManagerAddress": "c", "Resources": {"CPU": 64.0, "csx": 8.0}},
        {"Alive": True, "NodeManagerAddress": "api", "Resources": {"CPU": 0.0}},  # a driver node
    ]
    summary = summarise(nodes_from_ray(records))
    assert summary == ClusterSummary(systems=3, nodes=2, cpus_per_system=2.0,
                                     gpus_per_system=0.0, memory_per_system_bytes=4 * 2**30,
                                     gpus=2.0)
    assert "3 CS-2 systems on 2 Ray node(s)" in summary.describe()


def test_gpu_memory_is_what_each_gpu_node_declares_and_the_least_one_counts():
    def node(address, gpus, gib=None):
        resources = {"CPU": 8.0, "GPU": float(gpus), "memory": 2.0**36, "csx": 2.0}
        if gib is not None:
            resources[GPU_MEMORY_RESOURCE] = gib  # the node's GPUs together
        return {"Alive": True, "NodeManagerAddress": address, "Resources": resources}

    nodes = nodes_from_ray([node("a", 2, 160.0), node("b", 4, 96.0), node("c", 2), node("d", 0)])
    assert [n.gpu_memory_bytes / 2**30 for n in nodes] == [80.0, 24.0, 0.0, 0.0]
    summary = summarise(nodes)
    assert (summary.gpus, summary.gpu_memory_bytes) == (8.0, 24 * 2**30)
    assert "(24.0 GiB each)" in summary.describe()
    assert summarise(nodes[2:]).gpu_memory_bytes == 0.0  # no node declares it


def test_the_local_node_declares_its_gpus_memory_only_where_it_has_gpus(monkeypatch):
    monkeypatch.setattr(hardware, "visible_gpus", lambda: 2)
    monkeypatch.setattr(hardware, "gpu_memory_bytes", lambda: 80 * 2.0**30)
    assert machine_resources(2) == {"csx": 2, GPU_MEMORY_RESOURCE: 160.0}
    monkeypatch.setattr(hardware, "visible_gpus", lambda: 0)
    assert machine_resources(3) == {"csx": 3}


nodes_strategy = st.lists(st.builds(Node, address=st.just("n"), systems=st.integers(0, 4),
                                    cpus=st.integers(0, 16).map(float),
                                    gpus=st.integers(0, 4).map(float),
                                    memory_bytes=st.just(float(2**34))), min_size=1, max_size=4)


@settings(max_examples=200)
@given(nodes=nodes_strategy, num_csx=st.integers(1, 8))
def test_resolved_hardware_always_fits_the_nodes(nodes, num_csx):
    """Whatever the cluster, the defaults either place all systems or the job is refused up
    front (never a placement group that can never be met), and never ask for more CPUs than
    the nodes holding systems have."""
    try:
        hardware = per_system_hardware(nodes, num_csx)
    except ValueError:
        return
    assert hardware.cpus >= 1 and hardware.gpus in (0, 1)
    assert systems_that_fit(nodes, hardware.cpus, hardware.gpus) >= num_csx
    assert hardware.cpus * num_csx <= sum(n.cpus for n in nodes if n.systems)


@settings(max_examples=200)
@given(systems=st.integers(1, 8), nodes=st.integers(1, 3), cpus=st.integers(1, 8),
       num_csx=st.integers(1, 8), cpus_per_csx=st.none() | st.integers(1, 8))
def test_a_jobs_footprint_is_what_its_placement_group_holds(systems, nodes, cpus, num_csx,
                                                            cpus_per_csx):
    """The scheduler's view of a job's CPUs equals the runner's request on the same cluster
    (num_csx bundles of per_system_hardware's CPUs), so a job it admits fits beside the others."""
    summary = ClusterSummary(systems=systems * nodes, nodes=nodes, cpus_per_system=cpus / systems,
                             gpus_per_system=0.0, memory_per_system_bytes=2.0**30)
    cluster = [Node("n", systems=systems, cpus=cpus, gpus=0, memory_bytes=systems * 2.0**30)
               for _ in range(nodes)]
    used_cpus, used_gpus = job_footprint(summary, num_csx, cpus_per_csx=cpus_per_csx)
    try:
        hardware = per_system_hardware(cluster, num_csx, cpus_per_csx=cpus_per_csx)
    except ValueError:  # never placeable: the systems' share, and the runner refuses it
        assert used_cpus == pytest.approx(num_csx * cpus / systems)
        return
    assert (used_cpus, used_gpus) == (num_csx * hardware.cpus, 0.0)
    assert used_cpus <= cpus * nodes


def test_one_system_on_the_default_takes_every_core_so_a_second_job_waits():
    two_cores = summarise(TWO_CORES)
    assert job_footprint(two_cores, 1) == (2.0, 0.0)  # both cores: the capacity
    assert job_footprint(two_cores, 1, cpus_per_csx=1) == (1.0, 0.0)  # two such jobs fit
    assert job_footprint(two_cores, 2) == (2.0, 0.0)


def test_threads_follow_the_granted_cpus_up_to_the_cores_this_process_has():
    assert intra_op_threads(1) == 1
    assert intra_op_threads(10_000) == usable_cores()


def test_precision_keys_apply_on_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision({}, {}, cuda).autocast_dtype is None
    on_cpu = resolve_precision({"mixed_precision": True, "fp16_type": "bfloat16"}, {}, cpu)
    assert on_cpu.autocast_dtype is None and "applies on CUDA only" in on_cpu.applied
    bf16 = resolve_precision({"mixed_precision": True, "fp16_type": "cbfloat16"}, {}, cuda)
    assert (bf16.autocast_dtype, bf16.loss_scale) == (torch.bfloat16, None)
    assert resolve_precision({"use_bfloat16": True}, {}, cuda).autocast_dtype == torch.bfloat16
    fp16 = resolve_precision({"mixed_precision": True}, {"initial_loss_scale": 1024,
                                                         "steps_per_increase": 50}, cuda)
    assert (fp16.autocast_dtype, fp16.loss_scale, fp16.initial_scale, fp16.growth_interval) == (
        torch.float16, "dynamic", 1024.0, 50)
    fixed = resolve_precision({"mixed_precision": True, "fp16_type": "float16"},
                              {"loss_scaling_factor": 128}, cuda)
    assert (fixed.loss_scale, fixed.initial_scale) == (128.0, 128.0)
    with pytest.raises(ValueError, match="model.fp16_type"):
        resolve_precision({"mixed_precision": True, "fp16_type": "fp8"}, {}, cuda)
    with pytest.raises(ValueError, match="optimizer.loss_scaling_factor"):
        resolve_precision({"mixed_precision": True}, {"loss_scaling_factor": "auto"}, cuda)


def test_the_service_reads_the_planned_cluster_until_connected_then_the_live_one():
    planned = ClusterSummary(2, 1, 1.0, 0.0, 2**32)
    live = ClusterSummary(5, 3, 4.0, 1.0, 2**34)
    state = {"connected": False, "reads": 0}

    def read():
        state["reads"] += 1
        return live

    cluster = LiveCluster(lambda: planned, lambda: state["connected"], read)
    assert cluster.summary() is planned
    state["connected"] = True
    assert cluster.summary() is live and cluster.summary() is live
    assert state["reads"] == 1  # cached between refreshes


def test_csx_serve_says_what_cluster_it_found_without_a_ray_address(monkeypatch):
    from service.cli import found_cluster
    from service.settings import Settings

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    line = found_cluster(Settings(cluster_size=3))
    assert line.startswith("cluster (local Ray head, started with the first job): 3 CS-2 systems")
    assert "CPUs" in line and "GPUs" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_training_on_cuda_without_a_cuda_device_is_refused(tmp_path):
    from csx_config import JobSpec
    from training.loop import train

    with pytest.raises(ValueError, match="device 'cuda': torch sees no CUDA device"):
        train(plan_job(JobSpec.from_yaml("model: {preset: tiny}")), model_dir=str(tmp_path), device="cuda")


def test_the_loop_autocasts_and_scales_the_loss_as_its_precision_says(tmp_path, monkeypatch):
    """The CUDA precision path, run on CPU (bf16 autocast and a GradScaler both exist there):
    the scaler's state is checkpointed and a resume picks it up."""
    from csx_config import JobSpec
    from training import build
    from training import loop
    from training.checkpoint import checkpoint_path, load_checkpoint
    from training.precision import Precision

    scaled = Precision(torch.bfloat16, "dynamic", 256.0, 3, applied="bf16 + scaler (test)")
    monkeypatch.setattr(build, "resolve_precision", lambda *_: scaled)
    text = ("train_input: {batch_size: 4, max_sequence_length: 16}\nmodel: {preset: tiny}\n"
            "sparsity: {algorithm: rigl, sparsity: 0.5, update: {freq: 2}}\n"
            "runconfig: {max_steps: 4, checkpoint_steps: 2, log_steps: 2, sparse_kernel: dense}\n")
    first = loop.train(plan_job(JobSpec.from_yaml(text)), model_dir=str(tmp_path))
    assert first["precision"] == "bf16 + scaler (test)"
    assert [step for step, _ in first["mask_hashes"]] == [0, 2, 4]  # no step skipped
    scale = load_checkpoint(checkpoint_path(tmp_path, 4))["grad_scaler"]["scale"]
    assert scale == 512.0  # grew once: 3 finite steps of growth_interval 3
    resumed = loop.train(plan_job(JobSpec.from_yaml(text.replace("max_steps: 4", "max_steps: 6"))),
                         model_dir=str(tmp_path))
    assert [step for step, _ in resumed["train_losses"]] == [5, 6]
    assert load_checkpoint(checkpoint_path(tmp_path, 6))["grad_scaler"]["scale"] == 1024.0
