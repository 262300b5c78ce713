"""Batched MLflow logging for a training run (rank 0 only).

One `Tracker` per run attempt. Metrics are buffered and written with
`MlflowClient.log_batch` (at most 1000 per call, docs/design.md §6: 1000 single `log_metric` calls
take seconds, one batch takes 0.1 s). Mask updates become one artifact folder per update
step: bit-packed masks, a heatmap per layer and a density histogram.

The default store is SQLite: MLflow 3.x refuses the plain file store unless forced, and
SQLite needs no server and supports nested runs. URIs are made absolute so that a driver
and its Ray workers, which may run in other directories, write to the same store.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from tracking.plots import HeatmapWriter, write_curves_png, write_density_histogram_png
from tracking.server import MLFLOW_AWAY, MLFLOW_BACK, mlflow_unreachable
from training.plan import JobPlan

log = logging.getLogger(__name__)

MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE_CHARS = 6000
# Flush buffered metrics at least this often so a live MLflow UI follows the run.
FLUSH_INTERVAL_S = 10.0
# While its server does not answer, a tracker asks it again this often (one short request).
RETRY_S = 15.0
# In a run's spool folder: the metrics kept while the server is away, and where artifact files
# are written before they move, whole, to the artifacts waiting for upload.
SPOOLED_METRICS = "metrics.jsonl"
STAGING = ".staging"
PARENT_RUN_TAG = "mlflow.parentRunId"
# What MLflow accepts as a param name (letters, digits, _ - . / space and colon).
PARAM_KEY = re.compile(r"[\w\-./ :]+")
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow 3's experiment kind: "Machine learning", whose experiment page opens on its runs.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
# Curves whose last value a finished run also logs once, as `final/<name>`: a metric with one
# point is a bar per run in MLflow's chart view, where final values a few tenths apart differ
# visibly (on a shared line chart they overlap at the end of curves spanning tens of units).
FINAL_METRICS = ("eval/perplexity", "eval/loss", "train/loss")
# MLflow 3 groups charts into sections by a metric's name up to its last "/" and orders the
# sections by plain string comparison ("eval" < "final" < "perf" < "sparsity" < "train"), on a
# run's page and in the chart view alike. The per-layer levels (`sparsity/<param>/actual` and
# `/target` from the library) are logged under `weights/...`, which sorts after every headline
# section, in one section per kind with a short layer name as the chart title
# (`weights/sparsity/L03.attn.q`); `layer_names.json` maps the short names back.
LAYER_METRICS = {"actual": "weights/sparsity/", "target": "weights/target/"}
LAYER_NAMES_FILE = "layer_names.json"
# How a parameter name shortens: (pattern, replacement), applied in order.
_SHORT_NAME_RULES = (
    (re.compile(r"\.(expert_)?weights?$"), ""),
    (re.compile(r"^transformer_decoder\.layers\.(\d+)\."), lambda m: f"L{int(m[1]):02d}."),
    (re.compile(r"self_attn\.proj_(\w+?)_dense_layer"), r"attn.\1"),
    # the experts in each of ModelZoo's layouts (models/moe.py)
    (re.compile(r"ffn\.experts\.experts\.(\d+)\.(?:ffn\.)?(\d+)\.linear_layer_for_glu"), r"expert\1.ffn\2.glu"),
    (re.compile(r"ffn\.experts\.experts\.(\d+)\.(?:ffn\.)?(\d+)\.linear_layer"), r"expert\1.ffn\2"),
    (re.compile(r"ffn\.experts\.shared_experts\.(\d+)\.ffn\.(\d+)\.linear_layer_for_glu"), r"shared\1.ffn\2.glu"),
    (re.compile(r"ffn\.experts\.shared_experts\.(\d+)\.ffn\.(\d+)\.linear_layer"), r"shared\1.ffn\2"),
    (re.compile(r"ffn\.experts\.fused_ffns\.(\d+)\.linear_layer_for_glu"), r"experts.ffn\1.glu"),
    (re.compile(r"ffn\.experts\.fused_ffns\.(\d+)\.linear_layer"), r"experts.ffn\1"),
    (re.compile(r"ffn\.ffn\.(\d+)\.linear_layer_for_glu"), r"ffn\1.glu"),
    (re.compile(r"ffn\.ffn\.(\d+)\.linear_layer"), r"ffn\1"),
)


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The URI from the argument, else MLFLOW_TRACKING_URI, else ./mlflow.db; made absolute."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return Path(uri[len("file:"):]).resolve().as_uri()
    if "://" not in uri and not uri.startswith("file:"):
        return Path(uri).resolve().as_uri()
    return uri


def get_or_create_experiment(client: MlflowClient, name: str) -> str:
    """Experiment id for `name`; two processes creating it at once both get the same id.

    The experiment is marked as model training (`EXPERIMENT_KIND_TAG`): MLflow 3 otherwise
    opens an experiment without runs on its GenAI overview (traces), not on the runs.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"experiment must be a non-empty string, got {name!r}")
    found = client.get_experiment_by_name(name)
    if found is not None:
        if EXPERIMENT_KIND_TAG not in found.tags:
            client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        return found.experiment_id
    return new_experiment(client, name) or client.get_experiment_by_name(name).experiment_id


def new_experiment(client: MlflowClient, name: str) -> str | None:
    """Create experiment `name` (marked as model training) and return its id; None when an
    experiment of that name exists already, whoever made it."""
    try:
        return client.create_experiment(name, artifact_location=artifact_location(
            client.tracking_uri, name), tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        return None


def artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a SQLite store go beside the database, not into the caller's cwd."""
    if not tracking_uri.startswith("sqlite:///"):
        return None  # a server or other store chooses its own artifact root
    database = Path(tracking_uri[len("sqlite:///"):])
    return (database.parent / "mlartifacts" / safe_file_name(experiment)).as_uri()


def create_run(experiment: str, *, tracking_uri: str | None = None,
               parent_run_id: str | None = None, run_name: str | None = None,
               tags: Mapping[str, str] | None = None, experiment_id: str | None = None) -> str:
    """Create a run (nested under `parent_run_id` when given) and return its id.

    The run goes into experiment `experiment_id` when given (the service's jobs: it owns
    their experiments, service/experiments.py), else into the experiment named `experiment`.
    The runner calls this in the driver so the id is known before any worker starts and
    every retry of a job logs to the same run.
    """
    client = MlflowClient(tracking_uri=resolve_tracking_uri(tracking_uri))
    run_tags = {str(k): str(v) for k, v in (tags or {}).items()}
    if parent_run_id is not None:
        client.get_run(parent_run_id)  # fails loudly on an unknown parent
        run_tags[PARENT_RUN_TAG] = parent_run_id
    run = client.create_run(experiment_id or get_or_create_experiment(client, experiment),
                            run_name=run_name, tags=run_tags)
    return run.info.run_id


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts become dotted keys ("optimizer.learning_rate"); values become strings.

    A mapping whose keys MLflow would refuse as param names (the regex keys of a legacy
    `param_name_patterns` dict) stays one value, its text.
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and all(
                PARAM_KEY.fullmatch(str(k)) for k in value):
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = str(value)[:MAX_PARAM_VALUE_CHARS]
    return flat


def run_params(spec: Mapping[str, Any], num_csx: int) -> dict[str, str]:
    """The headline params of docs/design.md §5 from a params dict, then every section flattened
    ("sparsity.init_sparsity", "runconfig.max_steps", "optimizer.weight_decay", ...), so
    whatever distinguishes two variants is a param the runs table can show. A learning-rate
    schedule is one line per phase (`optimizer.learning_rate.phase1`, ...) and `lr` the
    phases in one line."""
    train_input = spec.get("train_input") or {}
    optimizer = dict(spec.get("optimizer") or {})
    runconfig = spec.get("runconfig") or {}
    schedule = optimizer.get("learning_rate")
    if isinstance(schedule, (list, Mapping)):
        phases = describe_lr_schedule(schedule)
        optimizer["learning_rate"] = {f"phase{i}": phase for i, phase in enumerate(phases, 1)}
        schedule = "; then ".join(phases)
    params: dict[str, Any] = {
        "num_csx": num_csx,
        "global_batch": train_input.get("batch_size"),
        "seq_len": train_input.get("seq_len", train_input.get("max_sequence_length")),
        "lr": schedule,
        "seed": runconfig.get("seed"),
    }
    params.update(sparsity_params(spec.get("sparsity")))
    flat = flatten_params({k: v for k, v in params.items() if v is not None})
    sections = {name: section for name, section in spec.items() if section is not None}
    if optimizer:
        sections["optimizer"] = optimizer
    if isinstance(sections.get("sparsity"), list):  # groups: sparsity.group0.algorithm, ...
        sections["sparsity"] = {f"group{i}": group for i, group in enumerate(spec["sparsity"])}
    flat.update(flatten_params(sections))
    return flat


def job_params(plan: JobPlan) -> dict[str, str]:
    """`run_params` of a job with its model as planned: the keys a preset or ModelZoo's
    defaults fill, and the data's vocabulary, in place of the file's unset ones."""
    data = dict(plan.loop.spec_json)
    data["model"] = {**data["model"], **asdict(plan.model)}
    return run_params(data, plan.num_csx)


def cli_run_name(params_file: str, algorithm: str) -> str:
    """A `csx run`'s run name: its params file, and the algorithm when the name lacks it, so
    runs of different files differ in one experiment (`rigl`, `ablation-3 (rigl)`)."""
    stem = Path(params_file).stem
    return stem if algorithm.lower() in stem.lower() else f"{stem} ({algorithm})"


def open_run(plan: JobPlan, *, tracking_uri: str | None = None,
             parent_run_id: str | None = None, run_name: str | None = None,
             tags: Mapping[str, str] | None = None, experiment_id: str | None = None) -> str:
    """Create a job's MLflow run with its params and the params YAML, the same on 1 and on N
    systems.

    The run is named `run_name` (a study variant, a job's name, a params file), else after its
    algorithm, and tagged `csx.algorithm`, `csx.variant` (the name) and `csx.num_csx` besides
    `tags`: MLflow's own random names would say nothing about which run is which.
    """
    params = job_params(plan)
    name = run_name or params["algorithm"]
    run_tags = {"csx.algorithm": params["algorithm"], "csx.variant": name,
                "csx.num_csx": str(plan.num_csx), **(tags or {})}
    tracking_uri = resolve_tracking_uri(tracking_uri)
    run_id = create_run(plan.experiment, tracking_uri=tracking_uri, parent_run_id=parent_run_id,
                        run_name=name, tags=run_tags, experiment_id=experiment_id)
    client = MlflowClient(tracking_uri=tracking_uri)
    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start:start + MAX_PARAMS_PER_BATCH])
    client.log_text(run_id, plan.loop.params_yaml, "params.yaml")
    return run_id


# How a scheduler's numbers read in one line: (from, to) keys, else its other keys as k=v.
_LR_RANGE = ("initial_learning_rate", "end_learning_rate")


def describe_lr_schedule(schedule: list[Mapping[str, Any]] | Mapping[str, Any]) -> list[str]:
    """One line per scheduler of a ModelZoo `learning_rate` list, without its unset keys:
    "steps 0-715: Linear 0 -> 0.0006", "steps 716-4777: CosineDecay 0.0006 -> 6e-05". The
    step range is known while every phase before it gives `total_iters`."""
    phases = [schedule] if isinstance(schedule, Mapping) else list(schedule)
    lines, start = [], 0
    for phase in phases:
        values = {k: v for k, v in phase.items() if v is not None and k != "scheduler"}
        name = str(phase.get("scheduler", "scheduler"))
        if all(k in values for k in _LR_RANGE):
            text = f"{name} {_number(values.pop(_LR_RANGE[0]))} -> {_number(values.pop(_LR_RANGE[1]))}"
        elif start_key := next((k for k in ("initial_learning_rate", "learning_rate")
                                if k in values), None):
            text = f"{name} {_number(values.pop(start_key))}"
        else:
            text = name
        iters = values.pop("total_iters", None)
        extra = ", ".join(f"{k}={_number(v)}" for k, v in values.items())
        text += f" ({extra})" if extra else ""
        if start is not None and iters is not None:
            text = f"steps {start}-{start + iters - 1}: {text}"
            start += iters
        else:
            text = (f"from step {start}: " if start is not None else "") + text
            start = None
        lines.append(text)
    return lines


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def sparsity_params(section: Any) -> dict[str, Any]:
    """algorithm, target_sparsity, init_method, distribution, update_*, drop_fraction_*."""
    if section is None:
        return {"algorithm": "dense", "target_sparsity": 0.0}
    if isinstance(section, (int, float)):
        return {"algorithm": "static", "target_sparsity": section}
    if isinstance(section, Mapping) and "groups" in section:
        section = section["groups"]
    if isinstance(section, list):
        groups = [sparsity_params(group) for group in section]
        return {"algorithm": "+".join(str(g.get("algorithm")) for g in groups),
                "groups": len(groups)}
    if not isinstance(section, Mapping):
        return {"algorithm": str(section)}
    target = section.get("sparsity", section.get("schedule"))
    if isinstance(target, Mapping):  # a schedule: its final value is the headline target
        target = target.get("end_sparsity", target.get("final", target.get("value", target)))
    update = section.get("update")
    if not isinstance(update, Mapping):
        update = {"freq": update} if update is not None else {}
    drop = section.get("drop_fraction")
    drop_init, drop_type = (drop.get("init"), drop.get("type")) if isinstance(
        drop, Mapping) else (drop, "constant" if drop is not None else None)
    return {
        "algorithm": section.get("algorithm", section.get("type", "static")),
        "target_sparsity": target,
        "init_method": section.get("init_method"),
        "distribution": section.get("distribution"),
        "update_freq": update.get("freq"),
        "update_stop": update.get("stop"),
        "drop_fraction_init": drop_init,
        "drop_fraction_type": drop_type,
    }


def short_layer_name(name: str) -> str:
    """"transformer_decoder.layers.3.self_attn.proj_q_dense_layer.weight" -> "L03.attn.q";
    a name no rule matches stays as it is."""
    for pattern, replacement in _SHORT_NAME_RULES:
        name = pattern.sub(replacement, name)
    return name


def layer_display_names(names: Iterable[str]) -> dict[str, str]:
    """Full parameter name -> the name its charts show: the short names, unless two layers
    would share one, then the full names."""
    shorts = {name: short_layer_name(name) for name in names}
    distinct = len(set(shorts.values())) == len(shorts)
    return shorts if distinct else {name: name for name in shorts}


def split_layer_metric(key: str) -> tuple[str, str] | None:
    """"sparsity/<param>/actual" -> ("<param>", "actual"); None for any other metric."""
    if not key.startswith("sparsity/"):
        return None
    name, _, kind = key.removeprefix("sparsity/").rpartition("/")
    return (name, kind) if name and kind in LAYER_METRICS else None


def pack_masks(masks: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Bit-packed masks plus their shapes, the arrays stored in `masks.npz`."""
    arrays: dict[str, np.ndarray] = {}
    for name, mask in masks.items():
        flat = mask.detach().to("cpu", torch.bool).numpy().reshape(-1)
        arrays[f"{name}.bits"] = np.packbits(flat)
        arrays[f"{name}.shape"] = np.asarray(mask.shape, dtype=np.int64)
    return arrays


def unpack_masks(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of `pack_masks`: name -> bool array of the original shape."""
    masks: dict[str, np.ndarray] = {}
    for key in arrays:
        if key.endswith(".shape"):
            name = key[: -len(".shape")]
            shape = tuple(int(d) for d in arrays[key])
            count = int(np.prod(shape))
            bits = np.unpackbits(arrays[f"{name}.bits"], count=count)
            masks[name] = bits.astype(bool).reshape(shape)
    return masks


class Tracker:
    """Batched MLflow logging for one run; create it on rank 0 only.

    Training does not wait for a tracking server that stops answering: every write first asks
    the server (tracking/server.py, one short request) and, while it is away, what would have
    been sent waits in the run's spool folder (`spool_dir/<run id>`): the metrics in
    `metrics.jsonl` (appended to at each `flush`, which the loop calls before every checkpoint, so a
    resume from that checkpoint sends them) and the artifacts as the files they upload as. The
    server is asked again every `RETRY_S`; `finish` waits for it. `notify` hears
    `{"event": MLFLOW_AWAY, "reason": ...}` and `{"event": MLFLOW_BACK}` as the server leaves
    and comes back.
    """

    def __init__(self, experiment: str, run_id: str | None = None,
                 tracking_uri: str | None = None, parent_run_id: str | None = None,
                 run_name: str | None = None, spool_dir: str | Path | None = None,
                 notify: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self._notify = notify
        self._away: str | None = None  # why the server does not answer, while it does not
        self._next_ask = 0.0  # when to ask an away server again (time.monotonic)
        self._wait(self._answers)  # nothing to log to without the run
        attached = run_id is not None
        if run_id is None:
            run_id = create_run(experiment, tracking_uri=self.tracking_uri,
                                parent_run_id=parent_run_id, run_name=run_name)
        else:
            run = self.client.get_run(run_id)  # fails loudly on an unknown id
            if run.info.status != "RUNNING":  # a retry re-opens the run it logs to
                self.client.update_run(run_id, status="RUNNING")
            if parent_run_id is not None and run.data.tags.get(PARENT_RUN_TAG) != parent_run_id:
                self.client.set_tag(run_id, PARENT_RUN_TAG, parent_run_id)
        self.run_id: str = run_id
        self.spool = Path(spool_dir) / run_id if spool_dir is not None else Path(
            tempfile.mkdtemp(prefix=f"csx-mlflow-{run_id}-"))
        self._artifacts = self.spool / "artifacts"
        self._pending: list[Metric] = []
        self._spooled = 0  # how many of `_pending` (the first ones) the spool file holds
        self._last_flush = time.monotonic()
        self._history: dict[str, list[tuple[int, float]]] = {}
        # (key, step) already written to the run, by this tracker or an earlier attempt: a
        # retry re-runs the steps after its checkpoint, and a metric has one value per step.
        self._logged: set[tuple[str, int]] = set()
        self._layer_names: dict[str, str] = {}  # full parameter name -> its charts' name
        if attached:
            self._load_logged()
        shutil.rmtree(self.spool / STAGING, ignore_errors=True)  # a killed attempt's half-writes
        self._load_spooled()
        self._heatmaps = HeatmapWriter()
        self._finished = False

    def _load_logged(self) -> None:
        for key in self.client.get_run(self.run_id).data.metrics:
            for metric in self.client.get_metric_history(self.run_id, key):
                self._logged.add((key, metric.step))
                self._history.setdefault(key, []).append((metric.step, metric.value))

    def _load_spooled(self) -> None:
        """The metrics an earlier attempt kept while the server was away, unless sent; the
        line a kill cut short is dropped, and the file rewritten whole for appending to."""
        spooled = self.spool / SPOOLED_METRICS
        if not spooled.is_file():
            return
        for line in spooled.read_text().splitlines():
            try:
                key, value, timestamp, step = json.loads(line)
            except ValueError:
                continue
            if (key, step) not in self._logged:
                self._logged.add((key, step))
                self._pending.append(Metric(key, value, timestamp, step))
                self._history.setdefault(key, []).append((step, value))
        part = spooled.with_name(f".{SPOOLED_METRICS}.part")
        part.write_text("".join(_spool_line(metric) for metric in self._pending))
        os.replace(part, spooled)
        self._spooled = len(self._pending)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer metrics; they are written 1000 at a time, every 10 s, and at `finish`.

        A key already logged at `step` is skipped (the first value stands), so no history
        holds two points for one step. Per-layer levels are renamed (`LAYER_METRICS`).
        """
        timestamp = int(time.time() * 1000)
        for key, value in self._chart_names(metrics).items():
            if (key, int(step)) in self._logged:
                continue
            self._logged.add((key, int(step)))
            number = float(value)
            self._pending.append(Metric(key, number, timestamp, int(step)))
            self._history.setdefault(key, []).append((int(step), number))
        if len(self._pending) >= MAX_METRICS_PER_BATCH or (
                time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S):
            self.flush()

    def _chart_names(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """`sparsity/<param>/actual` -> `weights/sparsity/<short name>`, target likewise. The
        names are fixed by the first call that logs layers (every call logs all of them) and
        written to `layer_names.json` (short -> full) whenever a layer is new."""
        layers = {key: found for key in metrics if (found := split_layer_metric(key))}
        new = {name for name, _ in layers.values()} - set(self._layer_names)
        if new:
            taken = set(self._layer_names.values())
            for name, shown in layer_display_names(new).items():
                self._layer_names[name] = name if shown in taken else shown
            self.log_text(json.dumps({shown: name for name, shown in self._layer_names.items()},
                                     indent=1, sort_keys=True), LAYER_NAMES_FILE)
        return {LAYER_METRICS[layers[key][1]] + self._layer_names[layers[key][0]]
                if key in layers else key: value for key, value in metrics.items()}

    def flush(self) -> None:
        """Send every buffered metric and waiting artifact; while the server is away, write the
        metrics to the spool instead, for this tracker's next flush or a resume's."""
        if not (self._send_metrics() and self._send_artifacts()):
            self._spool_metrics()
        self._last_flush = time.monotonic()

    def history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs logged under `key` by this tracker."""
        return list(self._history.get(key, []))

    def log_mask_update(self, step: int, masks: Mapping[str, torch.Tensor]) -> None:
        """Artifacts under masks/step_<step>/: masks.npz, heatmap_<layer>.png, density_hist.png."""
        if not masks:
            raise ValueError("masks must name at least one masked parameter")
        with self._staged(f"masks/step_{step:07d}") as out:
            np.savez_compressed(out / "masks.npz", **pack_masks(masks))
            densities: dict[str, float] = {}
            for name, mask in masks.items():
                dense = mask.detach().to("cpu", torch.bool)
                densities[name] = float(dense.float().mean())
                self._heatmaps.write(dense.reshape(dense.shape[0], -1).numpy(),
                                     out / f"heatmap_{safe_file_name(name)}.png",
                                     name=name, step=step)
            write_density_histogram_png(densities, out / "density_hist.png",
                                        title=f"mask density, step {step}")
        self._send_artifacts()

    def log_text(self, text: str, artifact_file: str) -> None:
        """Artifact `artifact_file` (a path inside the run's artifacts) holding `text`."""
        folder, _, name = artifact_file.rpartition("/")
        with self._staged(folder) as out:
            (out / name).write_text(text)
        self._send_artifacts()

    def finish(self, status: str = "FINISHED") -> None:
        """Flush, draw the loss/perplexity curves and end the run, waiting for the server while
        it is away; later calls do nothing."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {status!r}")
        if self._finished:
            return
        if status == "FINISHED":
            self._log_final_values()
        curves = {k: v for k, v in self._history.items()
                  if k.endswith("loss") or k.endswith("perplexity")}
        if curves:
            with self._staged("report") as out:
                write_curves_png(curves, out / "curves.png")
        self.flush()
        self._wait(lambda: self._send_metrics() and self._send_artifacts())
        self._wait(lambda: self._send(lambda: self.client.set_terminated(self.run_id, status)))
        shutil.rmtree(self.spool, ignore_errors=True)
        self._finished = True

    def _log_final_values(self) -> None:
        """`final/eval_perplexity` etc.: each curve's last value, at its last step."""
        for key in FINAL_METRICS:
            points = self._history.get(key)
            if points:
                step, value = max(points)
                self.log_metrics({final_metric(key): value}, step=step)

    # ---- sending, and keeping while the server is away -----------------------------------------

    def _send_metrics(self) -> bool:
        """Write the buffered metrics, 1000 per batch; False when the server is away."""
        while self._pending:
            batch = self._pending[:MAX_METRICS_PER_BATCH]
            if not self._send(lambda: self.client.log_batch(self.run_id, metrics=batch)):
                return False
            del self._pending[:len(batch)]
            self._spooled = max(0, self._spooled - len(batch))  # sent from the spool's head
        (self.spool / SPOOLED_METRICS).unlink(missing_ok=True)
        return True

    def _send_artifacts(self) -> bool:
        """Upload the spool's artifacts, one top-level entry at a time, removing each once it
        is sent; False when the server is away."""
        if not self._artifacts.is_dir():
            return True
        for entry in sorted(self._artifacts.iterdir()):
            if entry.is_dir():
                upload = partial(self.client.log_artifacts, self.run_id, str(entry), entry.name)
            else:
                upload = partial(self.client.log_artifact, self.run_id, str(entry))
            if not self._send(upload):
                return False
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        return True

    def _spool_metrics(self) -> None:
        """Append the buffered metrics the spool does not hold yet (the first `_spooled` of
        them it does): each flush while the server is away writes only what is new."""
        if self._spooled == len(self._pending):
            return
        self.spool.mkdir(parents=True, exist_ok=True)
        with open(self.spool / SPOOLED_METRICS, "a") as out:
            out.writelines(_spool_line(metric) for metric in self._pending[self._spooled:])
        self._spooled = len(self._pending)

    @contextmanager
    def _staged(self, artifact_path: str) -> Iterator[Path]:
        """A folder to write artifact files in; once the block ends they move, each whole, to
        `artifact_path` in the spool (a killed write leaves nothing there to upload)."""
        staging = self.spool / STAGING
        staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=staging) as folder:
            yield Path(folder)
            target = self._artifacts / artifact_path
            target.mkdir(parents=True, exist_ok=True)
            for path in Path(folder).iterdir():
                os.replace(path, target / path.name)

    def _send(self, call: Callable[[], Any]) -> bool:
        """Make one MLflow call unless the server is away: False when it is, or when it left
        during the call (which failed); an error of a server that answers is raised."""
        if not self._answers():
            return False
        try:
            call()
        except Exception:
            if (away := mlflow_unreachable(self.tracking_uri)) is None:
                raise
            self._left(away)
            return False
        return True

    def _answers(self) -> bool:
        """Whether the server answers now; while it is away it is asked every RETRY_S only."""
        if self._away is not None and time.monotonic() < self._next_ask:
            return False
        if (away := mlflow_unreachable(self.tracking_uri)) is not None:
            self._left(away)
            return False
        if self._away is not None:
            self._away = None
            log.warning("the MLflow server answers again: sending what the run kept")
            self._tell({"event": MLFLOW_BACK})
        return True

    def _left(self, away: str) -> None:
        if self._away is None:
            log.warning("the MLflow server does not answer (%s): what the run logs waits for "
                        "it (asked again every %g s)", away, RETRY_S)
            self._tell({"event": MLFLOW_AWAY, "reason": away})
        self._away, self._next_ask = away, time.monotonic() + RETRY_S

    def _wait(self, attempt: Callable[[], bool]) -> None:
        """Repeat `attempt` until it succeeds, each time the server is due to be asked again."""
        while not attempt():
            time.sleep(max(0.0, self._next_ask - time.monotonic()))

    def _tell(self, event: dict[str, Any]) -> None:
        if self._notify is not None:
            self._notify(event)


def _spool_line(metric: Metric) -> str:
    return json.dumps([metric.key, metric.value, metric.timestamp, metric.step]) + "\n"


def final_metric(key: str) -> str:
    """"eval/perplexity" -> "final/eval_perplexity"."""
    return "final/" + key.replace("/", "_")


def end_run(run_id: str, status: str, tracking_uri: str | None = None) -> None:
    """Mark a run terminal from the driver (a failed or cancelled job) unless it already is,
    or its server does not answer: a cancel does not wait minutes for MLflow's client; the run
    stays RUNNING there, and a retry of the job re-opens it anyway."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {status!r}")
    tracking_uri = resolve_tracking_uri(tracking_uri)
    if (away := mlflow_unreachable(tracking_uri)) is not None:
        log.warning("MLflow run %s not marked %s: the server does not answer (%s)",
                    run_id, status, away)
        return
    client = MlflowClient(tracking_uri=tracking_uri)
    if client.get_run(run_id).info.status == RunStatus.to_string(RunStatus.RUNNING):
        client.set_terminated(run_id, status=status)


def safe_file_name(name: str) -> str:
    """A parameter name as a file name: dots and slashes become underscores."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
