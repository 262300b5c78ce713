"""``csx run --validate_only``: what a job would train, without training it.

``validate_plan`` builds the model on CPU (the presets are small), applies
``sparsity.configure(spec.sparsity)`` and reports, per sparsity group, the parameters it
matched; per layer the sparsity and non-zeros; dense and sparse FLOPs per token; and the
projected CS-2 step time on ``num_csx`` systems from the simulator's cost model.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from workers.job import build_sparse_model, model_config, optimizer_class
from workers.model import ModelConfig
from workers.perf import project, projection_metrics
from workers.spec import JobSpec

BYTE_VOCAB = 256
DEFAULT_BPE_VOCAB = 2048


def _attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """QKᵀ and AV, forward, counting the full (unmasked) T×T score matrix, as in Kaplan et al."""
    return 2 * 2 * config.n_layer * seq_len * config.d_model


def _groups(alg: Any) -> list[dict[str, Any]]:
    members = getattr(alg, "members", [alg])
    groups = []
    for index, member in enumerate(members):
        names = [name for name, _, _ in member.sparse_parameters()]
        if not names:
            raise ValueError(f"sparsity group {index} ({type(member).__name__.lower()}) matches no "
                             "parameter: check its param_filter / param_name_patterns against the "
                             "model's parameter names (csx run --validate_only --logging DEBUG lists them)")
        groups.append({"group": index, "algorithm": type(member).__name__.lower(), "parameters": names})
    return groups


def validate_plan(spec: JobSpec, num_csx: int) -> dict[str, Any]:
    """The plan as plain data; ValueError names the problem (batch not divisible by num_csx,
    a sparsity group matching no parameter, a bad sparsity config, an unknown optimizer)."""
    batch = spec.train_input.batch_size
    if num_csx < 1 or batch % num_csx:
        raise ValueError(f"train_input.batch_size ({batch}) must be divisible by num_csx ({num_csx})")
    optimizer_class(spec.optimizer.type)
    tokenizer = spec.model.tokenizer
    vocab = BYTE_VOCAB if tokenizer.type == "byte" else tokenizer.vocab_size or DEFAULT_BPE_VOCAB
    config = model_config(spec, vocab)
    model, alg = build_sparse_model(spec, config)
    built = model.built
    seq_len = spec.train_input.seq_len

    masks = {name: mask for name, _, mask in alg.sparse_parameters()} if alg is not None else {}
    layers, dense_linear, sparse_linear = [], 0, 0
    for name, param in model.named_parameters():
        if param.dim() != 2 or name == "embedding.weight":
            continue  # a lookup, not a matmul (a tied lm_head shares this tensor)
        nnz = int(masks[name].sum()) if name in masks else param.numel()
        dense_linear += param.numel()
        sparse_linear += nnz
        layers.append({"name": name, "shape": list(param.shape), "sparse": name in masks,
                       "sparsity": 1.0 - nnz / param.numel(), "nnz": nnz, "numel": param.numel()})
    if built.tie_embeddings:  # the tied head is a matmul too
        head = model.lm_head.weight
        dense_linear += head.numel()
        sparse_linear += head.numel()
        layers.append({"name": "lm_head.weight (tied)", "shape": list(head.shape), "sparse": False,
                       "sparsity": 0.0, "nnz": head.numel(), "numel": head.numel()})
    attention = _attention_flops_per_token(built, seq_len)
    dense_forward, sparse_forward = 2 * dense_linear + attention, 2 * sparse_linear + attention
    tokens = batch * seq_len
    projection = project(model, seq_len=seq_len, global_tokens=tokens, num_csx=num_csx)
    return {
        "num_csx": num_csx, "global_batch": batch, "batch_per_csx": batch // num_csx,
        "seq_len": seq_len, "tokens_per_step": tokens,
        "model": {**asdict(built), "parameters": model.num_parameters(),
                  "sparse_wide_sparsity": config.sparse_wide_sparsity},
        "algorithm": repr(alg) if alg is not None else None,
        "groups": _groups(alg) if alg is not None else [],
        "layers": layers,
        "dense_parameters": [name for name, _ in model.named_parameters() if name not in masks],
        "flops_per_token": {"dense_forward": dense_forward, "sparse_forward": sparse_forward,
                            "dense_train": 3 * dense_forward, "sparse_train": 3 * sparse_forward},
        "projection": {k.removeprefix("perf/"): v for k, v in projection_metrics(projection).items()},
    }


def plan_table(plan: dict[str, Any], *, debug: bool = False) -> str:
    """The plan as aligned text; ``debug`` also lists the parameters each group matched and
    every parameter left dense."""
    model = plan["model"]
    lines = [
        f"model: {model['n_layer']} layers, d_model {model['d_model']}, d_ff {model['d_ff']}, "
        f"{model['n_head']} heads, vocab {model['vocab_size']}, {model['parameters']:,} parameters"
        + (f" (Sparse-Wide s={model['sparse_wide_sparsity']})" if model["sparse_wide_sparsity"] else ""),
        f"batch: {plan['global_batch']} global = {plan['num_csx']} CS-2 x {plan['batch_per_csx']}, "
        f"seq_len {plan['seq_len']}, {plan['tokens_per_step']:,} tokens/step",
        f"sparsity: {plan['algorithm'] or 'none (dense)'}",
    ]
    for group in plan["groups"]:
        lines.append(f"  group {group['group']} {group['algorithm']}: {len(group['parameters'])} parameters")
        if debug:
            lines.extend(f"    matched {name}" for name in group["parameters"])
    if debug:
        lines.extend(f"  dense   {name}" for name in plan["dense_parameters"])
    width = max(len(layer["name"]) for layer in plan["layers"])
    lines.append(f"{'layer':<{width}}  {'shape':>12}  {'sparsity':>8}  {'nnz':>10}")
    for layer in plan["layers"]:
        shape = "x".join(map(str, layer["shape"]))
        lines.append(f"{layer['name']:<{width}}  {shape:>12}  {layer['sparsity']:>8.3f}  {layer['nnz']:>10,}")
    flops, proj = plan["flops_per_token"], plan["projection"]
    lines += [
        f"FLOPs/token (train): dense {flops['dense_train']:,}  sparse {flops['sparse_train']:,}  "
        f"({flops['dense_train'] / flops['sparse_train']:.2f}x fewer)",
        f"projected CS-2 step: {proj['sim_step_ms']:.3f} ms on {plan['num_csx']} system(s), "
        f"speedup vs dense {proj['speedup_vs_dense']:.2f}x, scaling efficiency {proj['scaling_efficiency']:.2f}",
    ]
    return "\n".join(lines)
