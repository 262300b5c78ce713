"""What a job's plan would train, without training it: ``csx run --validate_only`` prints it,
the service stores it with the job.

``plan_report`` builds the plan's model on the meta device (shapes only, so a 7B model
validates in seconds without allocating its weights), applies its sparsity section and
reports: the model and its parameter count; the hardware-only keys not applied here; per
sparsity group the parameters it matched (a group matching none is refused here); per layer the
shape, target sparsity and non-zeros; dense and sparse FLOPs per token; the projected CS-2 step
time, speed-up vs dense and scaling efficiency on ``num_csx`` systems (``simulator.cost_model``);
and the memory training would take on this machine (the memory rule that refuses a job is
training/memory.py's, at admission).

Sparsity, FLOPs and projection are at the level the run ends with: a schedule (GMP, cubic,
GraNet) reaches it at its last update step up to ``max_steps``; ``schedule`` gives the start
(step 0, or a resumed algorithm's step) and that end, each with its projected speed-up.
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from dataclasses import asdict
from typing import Any, NamedTuple

from torch import nn

from models.config import ModelConfig
from training import memory
from training.build import build_sparse_model, optimizer_class
from training.filters import checked_groups, unmatched_patterns
from training.plan import JobPlan


def _attention_context(config: ModelConfig, seq_len: int, layer: int = 1) -> int:
    """Keys each query of ``layer`` scores: the sequence, or the sliding window and its sink
    tokens (on every layer, or on the odd ones with sliding_window_every_other_decoder_layer)."""
    from simulator.cost_model import attended_keys

    return attended_keys(seq_len, config.window_of_layer(layer), config.attention_sink_tokens)


def _attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """QKᵀ and AV, forward, counting the full (unmasked) T×T score matrix, as in Kaplan et al.
    (a sliding window bounds T), over all query heads (inner_dim)."""
    return sum(2 * 2 * _attention_context(config, seq_len, layer) * config.inner_dim
               for layer in range(config.num_hidden_layers))


def _targets(alg: Any) -> dict[str, float]:
    """Each sparse parameter's scheduled sparsity at the algorithm's current step."""
    targets: dict[str, float] = {}
    for member in getattr(alg, "members", [alg]):
        targets.update(member.layer_targets(member.step))
    return targets


def _final_targets(alg: Any, max_steps: int) -> tuple[int, dict[str, float]]:
    """The sparsity each parameter has when the run ends (a GMP or cubic schedule has risen to
    its target by then): its group's target at the group's last update step up to max_steps,
    or at the current step for a group that never updates. Also the latest such step."""
    last, targets = 0, {}
    for member in getattr(alg, "members", [alg]):
        step = max(member.last_update_step(max_steps) or 0, member.step)
        last = max(last, step)
        targets.update(member.layer_targets(step))
    return last, targets


class _Matrix(NamedTuple):
    """One matmul of the planned model, read once for both ends of its schedule."""
    name: str  # the module's
    label: str  # the weight parameter's
    shape: tuple[int, ...]
    numel: int
    token_share: float  # a routed expert's tokens (model.token_share)


def _matrices(model: nn.Module) -> list[_Matrix]:
    return [_Matrix(name, label, tuple(weight.shape), weight.numel(), model.token_share(name))
            for name, label, weight in model.weight_matrices()]


def _attention_scores(model: nn.Module, seq_len: int) -> list[Any]:
    """The cost model's activation-only products (QKᵀ and AV): dense at every sparsity."""
    from simulator.cost_model import LayerShape

    return [LayerShape(f"{name}.scores", 2 * _attention_context(model.built, seq_len, int(name.split(".")[2])),
                       module.proj_q_dense_layer.out_features, streams_weights=False)  # all query heads
            for name, module in model.named_modules() if "attention" in type(module).__name__.lower()]


def _projection(matrices: list[_Matrix], scores: list[Any], densities: dict[str, float], tokens: int,
                num_csx: int) -> dict[str, float]:
    """The cost model's step for the model's linear layers at the planned densities (the
    masks of a meta model hold no values to read); a routed expert computes on its tokens only."""
    from simulator.cost_model import LayerShape, WaferScaleCluster, project_step

    layers = [LayerShape(m.label, m.numel // m.shape[-1], m.shape[-1], density=densities.get(m.label, 1.0),
                         token_share=m.token_share) for m in matrices]
    step = project_step(layers + scores, tokens, WaferScaleCluster(num_csx=num_csx))
    return {"sim_step_ms": step.step_ms, "dense_step_ms": step.dense_step_ms,
            "speedup_vs_dense": step.speedup_vs_dense, "scaling_efficiency": step.scaling_efficiency}


def training_memory(plan: JobPlan, parameters: int, sparse_weights: int, seq_len: int) -> dict[str, int]:
    """Bytes one worker needs to train (training.memory.training_memory) for the built model."""
    optimizer_class(plan.optimizer.optimizer_type)  # an unknown name is refused here, by name
    return memory.training_memory(plan.optimizer, plan.batch_per_csx, memory.shapes_of(plan.model, seq_len),
                                  parameters, sparse_weights, memory.FLOAT_BYTES)


def available_memory() -> int:
    """MemAvailable of this machine (where the simulated systems' workers run), in bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Recent reports by the plan's repr (plain data: the spec's values, in full). A submission is
# planned again at admission after its :validate, and each plan of a large model builds it
# module by module (most of the report's time); the machine's free memory is read each time.
_REPORTS: OrderedDict[str, dict[str, Any]] = OrderedDict()
_REPORTS_KEPT = 32
_REPORTS_LOCK = threading.Lock()


def plan_report(plan: JobPlan) -> dict[str, Any]:
    """The plan as plain data; ValueError names the problem (a sparsity group matching no
    parameter, a bad sparsity config, an unknown optimizer)."""
    key = repr(plan)
    with _REPORTS_LOCK:
        report = _REPORTS.get(key)
        if report is not None:
            _REPORTS.move_to_end(key)
    if report is None:
        report = _report(plan)
        with _REPORTS_LOCK:
            _REPORTS[key] = report
            while len(_REPORTS) > _REPORTS_KEPT:
                _REPORTS.popitem(last=False)
    report = copy.deepcopy(report)  # callers may change theirs
    report["memory"]["available"] = available_memory()
    return report


def _report(plan: JobPlan) -> dict[str, Any]:
    num_csx, batch, config = plan.num_csx, plan.data.train.batch_size, plan.model
    seq_len = plan.data.seq_len
    model, alg = build_sparse_model(config, plan.sparsity, seed=plan.seed, device="meta")
    built, tokens = model.built, batch * seq_len
    start_targets = _targets(alg) if alg is not None else {}
    final_step, targets = _final_targets(alg, plan.loop.max_steps) if alg is not None else (0, {})
    matrices, scores = _matrices(model), _attention_scores(model, seq_len)
    start, start_layers = _at_targets(built, matrices, scores, start_targets, seq_len, tokens, num_csx)
    final, layers = _at_targets(built, matrices, scores, targets, seq_len, tokens, num_csx)
    for layer, before in zip(layers, start_layers):
        layer["start_sparsity"] = before["sparsity"]
    parameters = model.num_parameters()
    memory = training_memory(plan, parameters, sum(layer["numel"] for layer in layers if layer["sparse"]),
                             seq_len)
    return {
        "num_csx": num_csx, "global_batch": batch, "batch_per_csx": plan.batch_per_csx,
        "seq_len": seq_len, "tokens_per_step": tokens,
        "not_applied": list(plan.not_applied),
        "warnings": unmatched_patterns(plan.sparsity, [name for name, _ in model.named_parameters()]),
        "model": {**asdict(built), "parameters": parameters, "kv_heads": built.kv_heads,
                  "active_parameters": model.num_active_parameters(),
                  "sparse_wide_sparsity": config.sparse_wide_sparsity, "features": config.features()},
        "algorithm": repr(alg) if alg is not None else None,
        "groups": checked_groups(alg) if alg is not None else [],
        "layers": layers,
        "dense_parameters": [name for name, _ in model.named_parameters() if name not in targets],
        # At the level the run ends with; "schedule" has the start too.
        "flops_per_token": final["flops_per_token"],
        "projection": final["projection"],
        "schedule": {"start": {"step": _start_step(alg), **_summary(start)},
                     "final": {"step": final_step, **_summary(final)}},
        "memory": {"per_worker": memory, "per_worker_total": sum(memory.values()),
                   "workers": num_csx, "total": num_csx * sum(memory.values())},
    }


def _start_step(alg: Any) -> int:
    if alg is None:
        return 0
    return max(member.step for member in getattr(alg, "members", [alg]))


def _at_targets(built: ModelConfig, matrices: list[_Matrix], scores: list[Any], targets: dict[str, float],
                seq_len: int, tokens: int, num_csx: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """FLOPs and the projected step at these per-parameter sparsities, and the layer rows. A
    routed expert counts for the tokens routed to it (top_k of num_experts)."""
    layers, dense_linear, sparse_linear = [], 0.0, 0.0
    for m in matrices:  # embeddings are lookups (a tied lm_head is a matmul)
        nnz = m.numel - round(targets.get(m.label, 0.0) * m.numel)
        dense_linear += m.token_share * m.numel
        sparse_linear += m.token_share * nnz
        layers.append({"name": m.label + (" (tied)" if m.name == "lm_head" and built.share_embedding_weights else ""),
                       "shape": list(m.shape), "sparse": m.label in targets,
                       "sparsity": 1.0 - nnz / m.numel, "nnz": nnz, "numel": m.numel,
                       "token_share": m.token_share})
    attention = _attention_flops_per_token(built, seq_len)
    dense_forward, sparse_forward = round(2 * dense_linear) + attention, round(2 * sparse_linear) + attention
    densities = {name: 1.0 - level for name, level in targets.items()}
    sparse = [layer for layer in layers if layer["sparse"]]
    return {
        "sparsity": 1.0 - sum(layer["nnz"] for layer in sparse) / max(1, sum(layer["numel"] for layer in sparse)),
        "flops_per_token": {"dense_forward": dense_forward, "sparse_forward": sparse_forward,
                            "dense_train": 3 * dense_forward, "sparse_train": 3 * sparse_forward},
        "projection": _projection(matrices, scores, densities, tokens, num_csx),
    }, layers


def _summary(level: dict[str, Any]) -> dict[str, float]:
    return {"sparsity": level["sparsity"], "sparse_train_flops": level["flops_per_token"]["sparse_train"],
            "speedup_vs_dense": level["projection"]["speedup_vs_dense"],
            "sim_step_ms": level["projection"]["sim_step_ms"]}


def _model_line(model: dict[str, Any]) -> str:
    heads = f"{model['num_heads']} heads"
    if model["kv_heads"] != model["num_heads"]:
        heads += f" ({model['kv_heads']} key/value)"
    positions = model["position_embedding_type"]
    if positions != "learned" and (model["pos_scaling_factor"] != 1.0 or model["pos_scaling_type"].lower() != "linear"):
        positions += f" ({model['pos_scaling_type'].lower()} scaling x{model['pos_scaling_factor']:g})"
    extras = list(model["features"])
    if model["active_parameters"] != model["parameters"]:  # routed experts a token skips
        extras.append(f"{model['active_parameters']:,} active")
    return (f"model: {model['model_class']}, {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, filter "
            f"{model['filter_size']}, {heads}, vocab {model['vocab_size']}, {positions} positions, "
            f"{model['norm_type']}, {model['nonlinearity']}, {model['parameters']:,} parameters"
            + (f" ({', '.join(extras)})" if extras else ""))


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def plan_table(plan: dict[str, Any], *, debug: bool = False) -> str:
    """The plan as aligned text; ``debug`` also lists the parameters each group matched and
    every parameter left dense."""
    model = plan["model"]
    lines = [
        _model_line(model),
        f"batch: {plan['global_batch']} global = {plan['num_csx']} CS-2 x {plan['batch_per_csx']}, "
        f"seq_len {plan['seq_len']}, {plan['tokens_per_step']:,} tokens/step",
        f"sparsity: {plan['algorithm'] or 'none (dense)'}",
    ]
    if plan["not_applied"]:
        lines.insert(0, f"not applied here (hardware-only keys): {', '.join(plan['not_applied'])}")
    lines[:0] = [f"warning: {warning}" for warning in plan["warnings"]]
    for group in plan["groups"]:
        lines.append(f"  group {group['group']} {group['algorithm']}: {len(group['parameters'])} parameters")
        if debug:
            lines.extend(f"    matched {name}" for name in group["parameters"])
    if debug:
        lines.extend(f"  dense   {name}" for name in plan["dense_parameters"])
    start, final = plan["schedule"]["start"], plan["schedule"]["final"]
    scheduled = any(layer["start_sparsity"] != layer["sparsity"] for layer in plan["layers"])
    if scheduled:
        lines.append(f"sparsity schedule: step {start['step']}: {start['sparsity']:.3f} (projected "
                     f"{start['speedup_vs_dense']:.2f}x) -> step {final['step']}: {final['sparsity']:.3f} "
                     f"(projected {final['speedup_vs_dense']:.2f}x); the table and totals below are at "
                     f"step {final['step']}")
    width = max(len(layer["name"]) for layer in plan["layers"])
    first = f"  {'step ' + str(start['step']):>10}" if scheduled else ""
    lines.append(f"{'layer':<{width}}  {'shape':>12}{first}  {'sparsity':>8}  {'nnz':>13}")
    for layer in plan["layers"]:
        shape = "x".join(map(str, layer["shape"]))
        first = f"  {layer['start_sparsity']:>10.3f}" if scheduled else ""
        lines.append(f"{layer['name']:<{width}}  {shape:>12}{first}  {layer['sparsity']:>8.3f}  {layer['nnz']:>13,}")
    flops, proj, memory = plan["flops_per_token"], plan["projection"], plan["memory"]
    lines += [
        f"sparsified weights: {sum(layer['sparse'] for layer in plan['layers'])} of {len(plan['layers'])} matmuls",
        f"FLOPs/token (train): dense {flops['dense_train']:,}  sparse {flops['sparse_train']:,}  "
        f"({flops['dense_train'] / flops['sparse_train']:.2f}x fewer)",
        f"projected CS-2 step: {proj['sim_step_ms']:.3f} ms on {plan['num_csx']} system(s) "
        f"(dense {proj['dense_step_ms']:.3f} ms), speedup vs dense {proj['speedup_vs_dense']:.2f}x, "
        f"scaling efficiency {proj['scaling_efficiency']:.2f}",
        f"training memory here: {memory['workers']} worker(s) x {_gib(memory['per_worker_total'])} = "
        f"{_gib(memory['total'])} of {_gib(memory['available'])} available"
        + ("" if memory["total"] <= memory["available"] else " -- too large to train here"),
    ]
    return "\n".join(lines)
