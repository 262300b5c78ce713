"""The ``trainer:`` layout of ModelZoo 2.3+ (``trainer.init`` / ``trainer.fit``), translated
to and from the params layout, key for key, with ModelZoo's own correspondence.

``init.model`` is ``model``, ``init.sparsity`` is ``sparsity``, ``fit.train_dataloader`` and
``fit.val_dataloader`` are ``train_input`` and ``eval_input``; ``init.optimizer`` is one
``{ClassName: {kwargs}}`` (``optimizer_type`` and the rest of ``optimizer``);
``init.schedulers`` holds one learning-rate scheduler (``SequentialLR`` for a list); the
single keys of ``backend``, ``precision``, ``loop``, ``checkpoint``, ``logging`` and the
flags of ``callbacks`` each have one params key (``KEYS``, ``CALLBACK_KEYS``). csx's own
runconfig keys that ModelZoo has no trainer home for sit in ``trainer.init.csx``. A
``trainer`` list (multi-phase training) is accepted with one phase.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

from csx_config.keys import Problem

# trainer path (below `trainer`) -> params path, for single values.
KEYS: dict[str, str] = {
    "init.model_dir": "runconfig.model_dir",
    "init.seed": "runconfig.seed",
    "init.backend.backend_type": "runconfig.target_device",
    "init.backend.compile_dir": "runconfig.compile_dir",
    "init.backend.compile_only": "runconfig.compile_only",
    "init.backend.validate_only": "runconfig.validate_only",
    "init.backend.cluster_config.num_csx": "runconfig.num_csx",
    "init.backend.cluster_config.max_wgt_servers": "runconfig.num_wgt_servers",
    "init.backend.cluster_config.max_act_per_csx": "runconfig.num_act_servers",
    "init.backend.cluster_config.num_workers_per_csx": "runconfig.num_workers_per_csx",
    "init.backend.cluster_config.mgmt_address": "runconfig.mgmt_address",
    "init.backend.cluster_config.mgmt_namespace": "runconfig.mgmt_namespace",
    "init.backend.cluster_config.credentials_path": "runconfig.credentials_path",
    "init.backend.cluster_config.mount_dirs": "runconfig.mount_dirs",
    "init.backend.cluster_config.python_paths": "runconfig.python_paths",
    "init.backend.cluster_config.cbcore_image": "runconfig.cbcore_image",
    "init.backend.cluster_config.job_labels": "runconfig.job_labels",
    "init.backend.cluster_config.job_priority": "runconfig.job_priority",
    "init.backend.cluster_config.job_time_sec": "runconfig.job_time_sec",
    "init.backend.cluster_config.disable_version_check": "runconfig.disable_version_check",
    "init.backend.enable_distributed": "runconfig.enable_distributed",
    "init.backend.main_process_id": "runconfig.main_process_id",
    "init.backend.dist_backend": "runconfig.dist_backend",
    "init.backend.init_method": "runconfig.init_method",
    "init.backend.sync_batchnorm": "runconfig.sync_batchnorm",
    "init.precision.enabled": "model.mixed_precision",
    "init.precision.fp16_type": "model.fp16_type",
    "init.precision.precision_opt_level": "runconfig.precision_opt_level",
    "init.precision.loss_scaling_factor": "optimizer.loss_scaling_factor",
    "init.precision.initial_loss_scale": "optimizer.initial_loss_scale",
    "init.precision.steps_per_increase": "optimizer.steps_per_increase",
    "init.precision.min_loss_scale": "optimizer.min_loss_scale",
    "init.precision.max_loss_scale": "optimizer.max_loss_scale",
    "init.precision.max_gradient_norm": "optimizer.max_gradient_norm",
    "init.precision.max_gradient_value": "optimizer.max_gradient_value",
    "init.precision.log_loss_scale": "optimizer.log_summaries",
    "init.loop.max_steps": "runconfig.max_steps",
    "init.loop.num_steps": "runconfig.num_steps",
    "init.loop.num_epochs": "runconfig.num_epochs",
    "init.loop.steps_per_epoch": "runconfig.steps_per_epoch",
    "init.loop.eval_frequency": "runconfig.eval_frequency",
    "init.loop.eval_steps": "runconfig.eval_steps",
    "init.loop.grad_accum_steps": "optimizer.grad_accum_steps",
    "init.checkpoint.steps": "runconfig.checkpoint_steps",
    "init.checkpoint.disable_strict_checkpoint_loading": "runconfig.disable_strict_checkpoint_loading",
    "init.checkpoint.autoload_last_checkpoint": "runconfig.autoload_last_checkpoint",
    "init.checkpoint.save_initial_checkpoint": "runconfig.save_initial_checkpoint",
    "init.logging.log_steps": "runconfig.log_steps",
    "init.logging.log_level": "runconfig.logging",
    "init.logging.wsc_log_level": "runconfig.wsc_log_level",
    "init.logging.enable_act_frequency": "runconfig.enable_act_frequency",
    "init.csx.max_failures": "runconfig.max_failures",
    "init.csx.mlflow_experiment": "runconfig.mlflow_experiment",
    "init.csx.sparse_kernel": "runconfig.sparse_kernel",
    "init.csx.torch_compile": "runconfig.torch_compile",
    "init.csx.cpus_per_csx": "runconfig.cpus_per_csx",
    "init.csx.gpus_per_csx": "runconfig.gpus_per_csx",
    "init.csx.placement_strategy": "runconfig.placement_strategy",
    "fit.ckpt_path": "runconfig.checkpoint_path",
}
# trainer path -> params section, for whole mappings.
SECTIONS: dict[str, str] = {"init.model": "model", "fit.train_dataloader": "train_input",
                            "fit.val_dataloader": "eval_input"}
# Eval-only entry points: their dataloader is the eval input when `fit` names none.
EVAL_ONLY = {"validate": ("val_dataloader", "ckpt_path"),
             "validate_all": ("val_dataloaders", "ckpt_paths")}
# callback -> {flag or argument: params path}; a callback without arguments sets its key true.
CALLBACK_KEYS: dict[str, dict[str, str] | str] = {
    "GlobalFlags": {f"csx.debug.{key}": f"runconfig.{key}" for key in (
        "ini", "debug_args", "retrace_every_iteration", "lazy_initialization",
        "log_initialization", "drop_data", "fabric_type_blacklist", "compile_crd_memory_gi",
        "execute_crd_memory_gi", "wrk_memory_gi", "act_memory_gi", "cmd_memory_gi",
        "wgt_memory_gi", "chf_memory_gi")} | {
        "csx.performance.transfer_processes": "runconfig.transfer_processes"},
    "ScopedTrainFlags": {"csx.performance.micro_batch_size": "train_input.micro_batch_size"},
    "ScopedValidateFlags": {"csx.performance.micro_batch_size": "eval_input.micro_batch_size"},
    "DebugArgsPath": {"debug_args_path": "runconfig.debug_args_path"},
    "LoadCheckpointStates": {"load_checkpoint_states": "runconfig.load_checkpoint_states"},
    "KeepNCheckpoints": {"n": "runconfig.max_checkpoints"},
    "HFCacheDir": {"cache_dir": "runconfig.hf_cache_dir"},
    "TensorBoardLogger": {"summary_dir": "runconfig.summary_dir",
                          "legacy_event_dirs": "runconfig.legacy_event_dirs"},
    "ComputeNorm": "optimizer.log_summaries",
    "LogInputSummaries": "runconfig.log_input_summaries",
    "CheckLoss": "runconfig.check_loss_values",
    "DumpActivations": "runconfig.dump_activations",
}
INIT_KEYS = frozenset({"backend", "model", "optimizer", "schedulers", "precision", "sparsity",
                       "loop", "checkpoint", "logging", "callbacks", "loggers", "seed",
                       "model_dir", "csx"})


def is_trainer(data: dict[str, Any]) -> bool:
    return "trainer" in data


def _get(tree: dict[str, Any], path: str) -> Any:
    node: Any = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[last] = value


def _pop(tree: dict[str, Any], path: str) -> Any:
    *parents, last = path.split(".")
    node = _get(tree, ".".join(parents)) if parents else tree
    return node.pop(last, _MISSING) if isinstance(node, dict) else _MISSING


_MISSING = object()


def phase(data: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """The one training phase of a ``trainer`` section (a mapping, or a list of one)."""
    trainer = data["trainer"]
    extra = [((key,), f"params.{key} is not a key of a trainer-layout file (only `trainer`)")
             for key in data if key != "trainer"]
    if isinstance(trainer, list):
        if len(trainer) != 1:
            return {}, [(("trainer",), f"trainer lists {len(trainer)} phases; multi-phase training "
                                       "is not supported here: run each phase as its own job")]
        trainer = trainer[0].get("trainer", trainer[0]) if isinstance(trainer[0], dict) else trainer[0]
    if not isinstance(trainer, dict):
        return {}, [(("trainer",), f"trainer must be a mapping, got {type(trainer).__name__}")]
    return copy.deepcopy(trainer), extra


def to_params(data: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """The params layout of a trainer-layout file, and the keys that have no params meaning."""
    trainer, problems = phase(data)
    params: dict[str, Any] = {}
    for path, section in SECTIONS.items():
        value = _pop(trainer, path)
        if value is not _MISSING:
            params[section] = value
    for path, target in KEYS.items():  # after the sections: precision.* goes into model and optimizer
        value = _pop(trainer, path)
        if value is not _MISSING:
            _set(params, target, value)
    for entry, (loader, ckpt) in EVAL_ONLY.items():
        node = trainer.pop(entry, None)
        if isinstance(node, dict):
            if loader in node and "eval_input" not in params:
                params["eval_input"] = node[loader]
            if node.get(ckpt) is not None and "checkpoint_path" not in params.get("runconfig", {}):
                _set(params, "runconfig.checkpoint_path", node[ckpt])
    init = trainer.pop("init", {}) or {}
    if "sparsity" in init:
        params["sparsity"] = init.pop("sparsity")
    problems += _optimizer_to_params(init, params)
    problems += _callbacks_to_params(init.pop("callbacks", None) or [], params, "callbacks")
    problems += _callbacks_to_params(init.pop("loggers", None) or [], params, "loggers")
    problems += _leftovers(init, ("trainer", "init"))
    problems += _leftovers(trainer, ("trainer",))
    return params, problems


def _leftovers(tree: dict[str, Any], loc: tuple[str, ...]) -> list[Problem]:
    """Keys no table consumed (empty mappings left by popping are fine), each with the known
    key it most likely meant."""
    problems = []
    for key, value in tree.items():
        if isinstance(value, dict) and not value:
            continue
        if isinstance(value, dict) and key in INIT_KEYS | {"fit", "backend", "cluster_config"}:
            problems += _leftovers(value, (*loc, key))
            continue
        path = ".".join(map(str, (*loc, key)))
        close = difflib.get_close_matches(str(key), sorted(_known_below(loc)), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(((*loc, key), f"{path} is not a key of the trainer layout csx knows{hint}"))
    return problems


def _known_below(loc: tuple[str, ...]) -> set[str]:
    """The keys the trainer layout has right below ``loc`` (``("trainer", "init", "loop")``)."""
    prefix = ".".join(loc[1:])
    paths = [*KEYS, *SECTIONS, *(f"init.{key}" for key in INIT_KEYS), *EVAL_ONLY, "init", "fit"]
    return {path.removeprefix(prefix + ".").split(".")[0] for path in paths
            if not prefix or path.startswith(prefix + ".")} if prefix else {p.split(".")[0] for p in paths}


def trainer_loc(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """Where a params-layout location (``("model", "hidden_size")``) is in a trainer file."""
    if not loc or loc[0] == "trainer":
        return loc
    for path, target in KEYS.items():
        if tuple(target.split(".")) == tuple(loc[:2]):
            return ("trainer", *path.split("."), *loc[2:])
    homes = {section: path for path, section in SECTIONS.items()}
    homes |= {"sparsity": "init.sparsity", "optimizer": "init.optimizer"}
    if tuple(loc[:2]) == ("optimizer", "learning_rate"):
        return ("trainer", "init", "schedulers", *loc[2:])
    home = homes.get(str(loc[0]))
    return ("trainer", *home.split("."), *loc[1:]) if home else ("trainer", *loc)


def _optimizer_to_params(init: dict[str, Any], params: dict[str, Any]) -> list[Problem]:
    problems: list[Problem] = []
    optimizer = params.setdefault("optimizer", {})
    chosen = init.pop("optimizer", None)
    if isinstance(chosen, dict) and len(chosen) == 1:
        (name, kwargs), = chosen.items()
        optimizer.update({"optimizer_type": name, **(kwargs or {})})
    elif chosen is not None:
        problems.append((("trainer", "init", "optimizer"),
                         "trainer.init.optimizer must name one optimizer class: {AdamW: {...}}"))
    schedulers = init.pop("schedulers", None)
    if schedulers is not None:
        rate, problem = _rate_from_schedulers(schedulers)
        if problem:
            problems.append((("trainer", "init", "schedulers"), problem))
        else:
            optimizer["learning_rate"] = rate
    return problems


def _scheduler_entry(entry: Any) -> dict[str, Any] | None:
    if isinstance(entry, dict) and len(entry) == 1:
        (name, kwargs), = entry.items()
        if isinstance(kwargs, dict) or kwargs is None:
            return {"scheduler": name, **(kwargs or {})}
    return None


def _unwrap_scale_per_param(entry: Any) -> Any:
    """The schedule a ``ScalePerParamLR`` wraps: that wrapper multiplies each parameter group's
    rate by the group's learning-rate factor (muP's lr_adjustment_groups), which every schedule
    here does already (training.build.make_optimizer)."""
    while (isinstance(entry, dict) and list(entry) == ["ScalePerParamLR"]
           and isinstance(entry["ScalePerParamLR"], dict) and list(entry["ScalePerParamLR"]) == ["scheduler"]):
        entry = entry["ScalePerParamLR"]["scheduler"]
    return entry


def _rate_from_schedulers(schedulers: Any) -> tuple[Any, str | None]:
    entries = schedulers if isinstance(schedulers, list) else [schedulers]
    if len(entries) != 1:
        return None, (f"trainer.init.schedulers holds {len(entries)} schedulers; csx runs one "
                      "learning-rate schedule (a SequentialLR for several in a row)")
    entry = _scheduler_entry(_unwrap_scale_per_param(entries[0]))
    if entry is None:
        return None, "trainer.init.schedulers[0] must be one {SchedulerName: {...}}"
    if entry["scheduler"] != "SequentialLR":
        return entry, None
    steps = [_scheduler_entry(item) for item in entry.get("schedulers") or []]
    if not steps or any(step is None for step in steps):
        return None, "trainer.init.schedulers[0].SequentialLR.schedulers must list {SchedulerName: {...}}"
    return steps, None


def _callbacks_to_params(callbacks: Any, params: dict[str, Any], kind: str) -> list[Problem]:
    if not isinstance(callbacks, list):
        return [(("trainer", "init", kind), f"trainer.init.{kind} must be a list")]
    problems: list[Problem] = []
    for index, callback in enumerate(callbacks):
        loc = ("trainer", "init", kind, index)
        name, args = next(iter(callback.items())) if isinstance(callback, dict) and len(callback) == 1 else (None, None)
        keys = CALLBACK_KEYS.get(name) if isinstance(name, str) else None
        if keys is None:
            problems.append((loc, f"trainer.init.{kind}[{index}] ({name or callback!r}) is not a "
                                  f"{kind[:-1]} csx knows: {sorted(CALLBACK_KEYS)}"))
        elif isinstance(keys, str):
            _set(params, keys, True if args in (None, {}) else args)
        else:
            for flag, value in (args or {}).items():
                if flag in keys:
                    _set(params, keys[flag], value)
                else:
                    problems.append(((*loc, name, flag), f"trainer.init.{kind}[{index}].{name}.{flag} "
                                                         f"is not a flag csx knows: {sorted(keys)}"))
    return problems


def from_params(params: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The trainer layout of a params-layout dict (``JobSpec.model_dump`` form), and the
    params keys that have no trainer home (hardware-only keys; they are left out)."""
    params = copy.deepcopy(params)
    init: dict[str, Any] = {}
    fit: dict[str, Any] = {}
    trainer = {"init": init, "fit": fit}
    for path, target in KEYS.items():
        value = _pop(params, target)
        if value is not _MISSING:
            _set(trainer, path, value)
    callbacks = _callbacks_from_params(params)
    optimizer = params.pop("optimizer", {}) or {}
    rate = optimizer.pop("learning_rate", None)
    name = optimizer.pop("optimizer_type", "AdamW")
    init["optimizer"] = {name: optimizer}
    if rate is not None:
        init["schedulers"] = [_schedulers_from_rate(rate)]
    for path, section in SECTIONS.items():
        if params.get(section):
            _set(trainer, path, params.pop(section))
    if params.get("sparsity") is not None:
        init["sparsity"] = params.pop("sparsity")
    if callbacks:
        init["callbacks"] = callbacks
    dropped = [f"{section}.{key}" for section, values in params.items() if isinstance(values, dict)
               for key in values]
    return {"trainer": trainer}, dropped


def _schedulers_from_rate(rate: Any) -> dict[str, Any]:
    def one(item: dict[str, Any]) -> dict[str, Any]:
        item = dict(item)
        return {item.pop("scheduler"): item}

    if isinstance(rate, list):
        return {"SequentialLR": {"schedulers": [one(item) for item in rate]}}
    if isinstance(rate, dict):
        return one(rate)
    return {"ConstantLR": {"learning_rate": rate}}


def _callbacks_from_params(params: dict[str, Any]) -> list[dict[str, Any]]:
    callbacks = []
    for name, keys in CALLBACK_KEYS.items():
        if isinstance(keys, str):
            value = _pop(params, keys)
            if value is not _MISSING:
                callbacks.append({name: {} if value is True else value})
            continue
        flags = {flag: value for flag, target in keys.items()
                 if (value := _pop(params, target)) is not _MISSING}
        if flags:
            callbacks.append({name: flags})
    return callbacks
