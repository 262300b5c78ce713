"""Issue 31: admission counts GPU memory per system. A job that trains on GPUs (gpus_per_csx > 0,
or unset where the cluster has a GPU per system) is refused at submit, naming gpus_per_csx and
both numbers, when its per-system estimate cannot fit one GPU as the cluster declares it, or
when the cluster has no GPUs. The cluster is a fake summary: no GPU is needed here."""

from __future__ import annotations

from fastapi.testclient import TestClient

from csx_config import JobSpec
from service_helpers import job_body
from workers.hardware import ClusterSummary
from training.memory import estimate

GPUS_PER_CSX = ["body", "params", "runconfig", "gpus_per_csx"]
BODY = job_body(model={"preset": "small"},
                train_input={"batch_size": 64, "max_sequence_length": 256})


def _need(body: dict, num_csx: int) -> int:
    return sum(estimate(JobSpec.model_validate(body["params"]), num_csx, on_gpu=True).values())


def _with_runconfig(body: dict, **keys: object) -> dict:
    params = body["params"]
    return {**body, "params": {**params, "runconfig": {**params["runconfig"], **keys}}}


def _cluster(client: TestClient, *, gpus_per_system: float, gpu_memory: float) -> None:
    settings = client.app.state.settings
    settings.paused = True  # admitted jobs stay queued
    summary = ClusterSummary(systems=4, nodes=1, cpus_per_system=4.0,
                             gpus_per_system=gpus_per_system, memory_per_system_bytes=2.0**40,
                             gpus=4 * gpus_per_system, gpu_memory_bytes=gpu_memory)
    settings.read_cluster_from(lambda: summary)


def _gpu_refusal(response) -> str:
    assert response.status_code == 422, response.text
    found = [e["msg"] for e in response.json()["detail"] if e["loc"] == GPUS_PER_CSX]
    assert found, response.json()
    return found[0]


def test_a_job_too_big_for_one_gpu_is_refused_naming_the_field_and_both_numbers(
        client: TestClient, alice: dict[str, str]) -> None:
    need = _need(BODY, 1)
    _cluster(client, gpus_per_system=1.0, gpu_memory=need / 2)
    for body, named in ((_with_runconfig(BODY, gpus_per_csx=1), "gpus_per_csx 1:"),
                        (BODY, "gpus_per_csx (unset: 1 here):")):  # the runner would grant one
        message = _gpu_refusal(client.post("/v1/jobs", json={**body, "num_csx": 1}, headers=alice))
        assert message.startswith(named)
        assert f"estimated {need / 2**30:,.2f} GiB" in message
        assert f"each GPU has {need / 2 / 2**30:,.2f} GiB" in message
    assert client.get("/v1/jobs", headers=alice).json()["count"] == 0
    cpu_only = _with_runconfig(BODY, gpus_per_csx=0)
    assert client.post("/v1/jobs", json={**cpu_only, "num_csx": 1}, headers=alice).status_code == 201


def test_more_systems_fit_a_job_that_one_gpu_cannot_hold(client: TestClient,
                                                         alice: dict[str, str]) -> None:
    one, four = _need(BODY, 1), _need(BODY, 4)
    assert four < one
    _cluster(client, gpus_per_system=1.0, gpu_memory=(one + four) / 2)
    body = _with_runconfig(BODY, gpus_per_csx=1)
    _gpu_refusal(client.post("/v1/jobs", json={**body, "num_csx": 1}, headers=alice))
    assert client.post("/v1/jobs", json={**body, "num_csx": 4}, headers=alice).status_code == 201


def test_asking_for_gpus_on_a_cluster_without_gpus_is_refused(client: TestClient,
                                                              alice: dict[str, str]) -> None:
    _cluster(client, gpus_per_system=0.0, gpu_memory=0.0)
    body = _with_runconfig(BODY, gpus_per_csx=1)
    message = _gpu_refusal(client.post("/v1/jobs", json=body, headers=alice))
    assert message.startswith("gpus_per_csx 1: the cluster has no GPUs") and "0 GPUs" in message
    assert client.post("/v1/jobs", json=BODY, headers=alice).status_code == 201  # CPUs, unset


def test_mixed_precision_halves_the_activations_on_a_gpu_only() -> None:
    plain = JobSpec.model_validate(BODY["params"])
    mixed = JobSpec.model_validate({**BODY["params"], "model": {
        **BODY["params"]["model"], "mixed_precision": True, "fp16_type": "bfloat16"}})
    on_gpu = estimate(mixed, 1, on_gpu=True)
    assert on_gpu["activations"] * 2 == estimate(plain, 1, on_gpu=True)["activations"]
    assert estimate(mixed, 1)["activations"] == estimate(plain, 1)["activations"]  # CPU: fp32
    assert {k: v for k, v in on_gpu.items() if k != "activations"} == \
        {k: v for k, v in estimate(plain, 1, on_gpu=True).items() if k != "activations"}
