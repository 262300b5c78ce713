"""Write docs/modelzoo_keys.md: every key of the ModelZoo corpus (tests/fixtures/modelzoo_corpus),
where it appears, what it means, and what csx does with it (read from csx_config's tables, so
the inventory cannot drift from the schema).

    python tools/modelzoo_keys.py [--corpus tests/fixtures/modelzoo_corpus] [--out docs/modelzoo_keys.md]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from csx_config import keys, params_v1, params_v2, trainer
from csx_config.families import MODELS_NOT_BUILT
from csx_config.inputs import InputSpec, TrainInputSpec
from csx_config.model import ModelSpec
from csx_config.sections import OptimizerSpec, RunConfigSpec

SECTIONS = {"train_input": TrainInputSpec, "eval_input": InputSpec, "model": ModelSpec,
            "optimizer": OptimizerSpec, "runconfig": RunConfigSpec}
MEANINGS = {
    "batch_size": "global batch size", "data_dir": "folder(s) of the data set",
    "data_processor": "which reader turns the files into batches",
    "max_sequence_length": "tokens per sample", "micro_batch_size": "per-step slice of the batch on the CS system",
    "mixed_precision": "16-bit compute", "num_workers": "input worker processes",
    "persistent_workers": "keep input workers alive between epochs", "prefetch_factor": "batches each worker reads ahead",
    "repeat": "loop over the data set", "shuffle": "shuffle samples", "shuffle_seed": "seed of the shuffle",
    "use_worker_cache": "cache the data on the appliance's workers", "vocab_size": "vocabulary size",
    "use_multiple_workers": "several input workers (CS-1)",
    "alibi_implementation": "ALiBi kernel", "allow_multireplica": "compile several model replicas per system",
    "attention_dropout_rate": "dropout on attention weights", "attention_kernel": "attention kernel choice",
    "attention_module": "attention variant (aiayn_attention, multiquery_attention)",
    "attention_sliding_window_length": "attend only to the last N tokens",
    "attention_softmax_fp32": "softmax in float32", "attention_type": "scaled or unscaled dot product",
    "boundary_casting": "casts at layer boundaries", "dropout_rate": "residual dropout",
    "embedding_dropout_rate": "dropout on embeddings", "embedding_initializer": "init of the embedding tables",
    "embedding_layer_norm": "layer norm after the embeddings", "embeddings_scale": "muP: scale of the embeddings' output",
    "extra_attention_params": "num_kv_groups: key/value heads (grouped-query attention)",
    "filter_size": "FFN width", "fixed_sparse_attention": "a fixed sparse attention mask",
    "fp16_type": "16-bit format (float16, bfloat16, cbfloat16)", "hidden_size": "model width",
    "initializer": "init of the other weights", "initializer_range": "std of the default init",
    "layer_norm_epsilon": "norm epsilon", "loss_scaling": "loss normalisation (batch_size / num_tokens)",
    "loss_weight": "constant factor on the loss", "max_position_embeddings": "longest sequence (position table)",
    "nonlinearity": "FFN activation (gelu, swiglu, ...)", "norm_type": "layernorm or rmsnorm",
    "num_heads": "attention heads", "num_hidden_layers": "decoder layers",
    "output_layer_initializer": "init of the output projections", "output_logits_scale": "muP: scale of the logits",
    "pos_scaling_extra_args": "RoPE scaling: Llama-3 frequency bands", "pos_scaling_factor": "RoPE scaling: context stretch",
    "pos_scaling_type": "RoPE scaling method (linear, llama3, yarn)",
    "position_embedding_type": "learned, rotary or alibi positions", "precision_opt_level": "CS compiler precision level",
    "rope_theta": "RoPE base", "rotary_dim": "dimensions rotated by RoPE",
    "scale_qk_dot_by_d": "muP: scale attention scores by 1/d instead of 1/sqrt(d)",
    "share_embedding_weights": "tie the LM head to the embeddings", "tf_summary": "TensorFlow summaries",
    "use_bfloat16": "bfloat16 compute", "use_bias_in_output": "bias of the LM head",
    "use_ffn_bias": "biases in the FFN", "use_ffn_bias_in_attention": "bias of the attention output projection",
    "use_position_embedding": "1.x: whether the model has position embeddings",
    "use_projection_bias_in_attention": "biases of the q/k/v projections", "use_rms_norm": "1.x: RMSNorm instead of LayerNorm",
    "adjust_learning_rate": "muP: per-layer learning-rate factors", "beta1": "1.x: Adam beta1",
    "beta2": "1.x: Adam beta2", "betas": "Adam betas", "correct_bias": "Adam bias correction",
    "disable_lr_steps_reset": "1.x: schedule step counting across restarts", "eps": "Adam epsilon",
    "epsilon": "1.x: Adam epsilon", "initial_loss_scale": "first dynamic loss scale",
    "learning_rate": "a rate, or scheduler(s)", "log_summaries": "log gradient norms",
    "loss_scaling_factor": "loss scaling for 16-bit (dynamic or a number)",
    "max_gradient_norm": "clip gradients to this global norm", "max_loss_scale": "largest loss scale",
    "optimizer_type": "optimizer class", "use_bias_correction": "1.x: Adam bias correction",
    "weight_decay": "decoupled weight decay", "weight_decay_rate": "older name of weight_decay",
    "ws_summary": "1.x weight-streaming summaries", "checkpoint_steps": "checkpoint every N steps",
    "compile_crd_memory_gi": "compile job memory", "compile_only": "compile without running",
    "disable_strict_checkpoint_loading": "allow partial checkpoints", "enable_distributed": "GPU: torch.distributed",
    "eval_frequency": "evaluate every N steps", "eval_steps": "batches per evaluation",
    "execute_crd_memory_gi": "execute job memory", "execution_strategy": "1.x pipeline or weight streaming",
    "keep_checkpoint_max": "checkpoints kept", "load_checkpoint_states": "which states a checkpoint load restores",
    "log_step_count_steps": "1.x logging cadence", "log_steps": "log every N steps",
    "max_checkpoints": "checkpoints kept", "max_steps": "training steps", "mode": "train / eval",
    "model_dir": "output folder", "num_wgt_servers": "weight servers of the appliance",
    "num_workers_per_csx": "input workers per system", "save_checkpoint_steps": "older name of checkpoint_steps",
    "save_initial_checkpoint": "checkpoint at step 0", "save_losses": "1.x: write losses to files",
    "save_summary_steps": "summaries every N steps", "seed": "random seed",
    "show_debug_metrics": "1.x debug metrics", "use_appliance_data": "read data on the appliance",
    "use_cs_grad_accum": "gradient accumulation chosen by the CS system", "validate_only": "compile check only",
    "mup_base_hidden_size": "muP: width of the base model", "mup_base_filter_size": "muP: FFN width of the base model",
    "output_logits_alpha": "muP: logit multiplier", "attention_sink_tokens": "attention sink tokens",
    "attention_inner_dim": "attention width", "data_transforms": "transforms applied to the samples",
    "name": "ModelZoo model class (gpt2, gptj, falcon, gemma2, mixtral, dpo, ...)",
    "residual_dropout_rate": "GPTJModel's residual dropout", "use_untied_layer_norm":
    "parallel block: separate norms before attention and MLP (GPT-NeoX) or one (GPT-J, Falcon)",
    "scale_qk_dot_by_layer_idx": "divide layer i's attention scores by i + 1",
    "scale_by_layer_index": "older name of scale_qk_dot_by_layer_idx",
    "attention_logit_softcapping": "Gemma-2: c·tanh(scores / c)", "final_logit_softcapping": "Gemma-2: c·tanh(logits / c)",
    "norm_first_sandwich": "Gemma-2: norm each sublayer's output too",
    "sliding_window_every_other_decoder_layer": "Gemma-2: sliding window on odd layers only",
    "moe": "mixture of experts (num_experts, top_k, load_balancing_loss_coef, shared experts, router)",
    "mixture": "weighted mixture of data sets", "num_examples": "examples of a synthetic data set",
    "dpo": "DPO loss settings (beta, reference_free)", "policy_model": "DPO: the model trained",
    "compute_eval_metrics": "DPO: reward metrics in eval", "model_name": "DPO: the policy's model class",
}
# The model keys of ModelZoo's DPO files (beside the policy's own): refused with the DPO class.
DPO_KEYS = ("dpo", "policy_model", "compute_eval_metrics", "model_name")
UPGRADES = {
    "model.use_position_embedding": "upgraded: true → the positions position_embedding_type gives; false → refused unless rotary",
    "model.use_rms_norm": "upgraded to norm_type: rmsnorm / layernorm",
    "optimizer.beta1": "upgraded to betas[0]", "optimizer.beta2": "upgraded to betas[1]",
    "optimizer.epsilon": "upgraded to eps", "optimizer.use_bias_correction": "upgraded to correct_bias",
    "optimizer.weight_decay_rate": "upgraded to weight_decay",
    "runconfig.save_checkpoint_steps": "upgraded to checkpoint_steps",
}


def raw_paths(data: dict[str, Any]) -> list[str]:
    """A file's keys: ``section.key`` (params) or ``trainer.…`` paths, callbacks as
    ``trainer.init.callbacks[].Name.flag``, one level into the model's nested keys."""
    if "trainer" not in data:
        return [f"{s}.{k}" if isinstance(v, dict) and s != "sparsity" else s
                for s, v in data.items() for k in (v if isinstance(v, dict) and s != "sparsity" else [None])]
    found = []
    tree = data["trainer"]
    for part in ("init", "fit"):
        for key, value in (tree.get(part) or {}).items():
            if key == "callbacks":
                found += [f"trainer.init.callbacks[].{name}" + (f".{flag}" if flag else "")
                          for item in value for name, args in item.items()
                          for flag in (args or {None: None})]
            elif isinstance(value, dict) and key not in ("sparsity", "optimizer"):
                found += [f"trainer.{part}.{key}.{sub}" for sub in value]
            else:
                found.append(f"trainer.{part}.{key}")
    return found + [f"trainer.{key}" for key in tree if key not in ("init", "fit")]


def params_equivalent(path: str) -> str | None:
    if not path.startswith("trainer."):
        return path
    match = re.fullmatch(r"trainer\.init\.callbacks\[\]\.(\w+)(?:\.(.+))?", path)
    if match:
        target = trainer.CALLBACK_KEYS.get(match[1])
        return target if isinstance(target, str) else (target or {}).get(match[2] or "")
    special = {"trainer.init.optimizer": "optimizer.optimizer_type",
               "trainer.init.schedulers": "optimizer.learning_rate", "trainer.init.sparsity": "sparsity",
               "trainer.init.backend.cluster_config": "runconfig.num_csx"}
    if path in special:
        return special[path]
    if path in ("trainer.validate", "trainer.validate_all"):
        return "eval_input"
    try:
        from csx_config.overrides import params_path

        return ".".join(params_path(path))
    except ValueError:
        return None


def what_csx_does(path: str | None) -> str:
    if path is None:
        return "refused: no meaning here"
    if path in ("sparsity", "eval_input"):
        return "applied" + (" (sparsity.configure)" if path == "sparsity" else "")
    if path in UPGRADES:
        return UPGRADES[path]
    if path in keys.UNSUPPORTED:
        key = path.split(".", 1)[1]
        standard = params_v2.STANDARD_VALUES.get(key)
        also = (f"; accepted when {' or '.join(map(str, standard))} (the standard decoder)"
                if standard and path.startswith("model.") else "")
        return f"refused: {keys.UNSUPPORTED[path]}{also}"
    section, _, key = path.partition(".")
    if section == "model" and key in DPO_KEYS:
        return f"refused: {MODELS_NOT_BUILT['dpo']} (the file is refused in one message naming DPO)"
    cls = SECTIONS.get(section)
    if cls is None:
        return "?"
    key = key.split(".")[0]
    if key in cls.ALIASES:
        return f"applied as `{cls.ALIASES[key]}`"
    if key in cls.model_fields:
        values = [v for (p, v) in keys.UNSUPPORTED_VALUES if p == path]
        return "applied" + (f" (refused: {', '.join(values)})" if values else "")
    if key in cls.known_keys():
        return "not applied: " + keys.NOT_APPLIED_REASONS.get(f"{section}.{key}", keys.HARDWARE_ONLY)
    return "refused: unknown key"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="tests/fixtures/modelzoo_corpus")
    parser.add_argument("--out", default="docs/modelzoo_keys.md")
    args = parser.parse_args()
    seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    files = sorted(Path(args.corpus).glob("*/*/*.yaml"))
    for path in files:
        layout, release = path.parts[-2], path.name.split("_", 1)[0]
        for key in raw_paths(yaml.safe_load(path.read_text())):
            seen[key][layout].add(release)
    version = lambda r: tuple(int(x) for x in re.findall(r"\d+", r)) or (99,)  # noqa: E731
    lines = [
        "# ModelZoo keys: where they appear and what csx does with them",
        "",
        f"Built by `python tools/modelzoo_keys.py` from the {len(files)} files of "
        "tests/fixtures/modelzoo_corpus (every decoder-only LM config Cerebras ModelZoo published: "
        "gpt2, gpt3 with Cerebras_GPT / muP / sparsity, llama, mistral, btlm, bloom, jais, gptj "
        "with GPT-NeoX, falcon, starcoder, santacoder, mpt, gemma2, mixtral with MoE, dpo; "
        "releases 1.6 to 2.10, each distinct version once). `params_v1`: releases 1.x; `params_v2`: 2.x params files; "
        "`trainer`: the `trainer:` layout (2.3+). Trainer keys show their params key. The sparsity "
        "section's own keys are passed to `sparsity.configure` and not listed. *Applied*: the key "
        "changes the run here; *upgraded*: a deprecated key read as its current meaning; *not "
        "applied*: accepted and listed by the plan (hardware, precision, logging); *refused*: the "
        "file is refused with the feature named.",
        "",
        "| key | layouts: releases | meaning | csx |",
        "|---|---|---|---|",
    ]
    for key in sorted(seen, key=lambda k: (k.startswith("trainer."), k)):
        where = "; ".join(f"{layout}: {min(r, key=version)}–{max(r, key=version)}" if len(r) > 1
                          else f"{layout}: {next(iter(r))}" for layout, r in sorted(seen[key].items()))
        target = params_equivalent(key)
        name = key.rstrip("]").split(".")[-1]
        meaning = MEANINGS.get(name, "")
        if key.startswith("trainer.") and target:
            meaning = f"= `{target}`" + (f": {MEANINGS[target.split('.')[-1]]}" if target.split(".")[-1] in MEANINGS else "")
        lines.append(f"| `{key}` | {where} | {meaning} | {what_csx_does(target)} |")
    lines += ["", "Deprecated keys are read as they were meant (csx_config.params_v1): "
              + "; ".join(f"`{k}`" for k in sorted(params_v1.RENAMED)) + ".", ""]
    Path(args.out).write_text("\n".join(lines), encoding="utf-8")
    print(f"{len(seen)} keys -> {args.out}")


if __name__ == "__main__":
    main()
