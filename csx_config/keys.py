"""What each key of a params file means here, beyond the schema's fields: the hardware-only
keys accepted but not applied (and why), the ModelZoo features refused (named, so the message
says what is missing), the hint for a key written the old way, and one error for all the
unknown keys of a section.

Every table is keyed by ``section.key`` in the params layout; the trainer layout is translated
to it first (csx_config.trainer). ``Section`` is a params section checked against them.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from csx_config.schedulers import rename_aliases

Problem = tuple[tuple[str | int, ...], str]  # (location, message)
HARDWARE_ONLY = "hardware-only (Cerebras appliance, precision or logging)"
# The precision keys a worker on a GPU applies (training/precision.py; the run reports it).
ON_CUDA_ONLY = "precision: applied on a CUDA device only; training on CPU is float32"
# Accepted, kept in the spec, listed as not applied; the reason when it is not HARDWARE_ONLY.
NOT_APPLIED_REASONS: dict[str, str] = {
    "runconfig.save_losses": "1.x: losses are always logged to MLflow here",
    "runconfig.show_debug_metrics": "1.x debug summaries of the CS system",
    "runconfig.log_step_count_steps": "1.x TensorFlow-era logging cadence; runconfig.log_steps applies",
    "runconfig.save_summary_steps": "TensorBoard summaries; metrics go to MLflow every log_steps",
    "runconfig.execution_strategy": "1.x pipeline / weight-streaming choice of the CS system",
    "runconfig.max_checkpoints": "checkpoint retention of the CS appliance",
    "optimizer.disable_lr_steps_reset": "1.x: the schedule here always counts from the global step",
    "optimizer.ws_summary": "1.x weight-streaming summaries",
    "train_input.use_multiple_workers": "1.x CS-1 input workers",
    "eval_input.use_multiple_workers": "1.x CS-1 input workers",
    "model.use_bfloat16": ON_CUDA_ONLY,
    "model.mixed_precision": ON_CUDA_ONLY,
    "model.fp16_type": ON_CUDA_ONLY,
    "optimizer.loss_scaling_factor": ON_CUDA_ONLY,
    "optimizer.initial_loss_scale": ON_CUDA_ONLY,
    "optimizer.steps_per_increase": ON_CUDA_ONLY,
    "model.allow_multireplica": "multi-replica compilation of the CS system",
    "model.alibi_implementation": "ALiBi kernel choice of the CS compiler",
    "optimizer.grad_accum_steps": "gradient accumulation: the same global batch trains the same here",
    "train_input.num_examples": "read only by ModelZoo's synthetic data processor, not its HDF5 ones",
    "eval_input.num_examples": "read only by ModelZoo's synthetic data processor, not its HDF5 ones",
}
# Keys each section accepts without applying them, beyond the section's own NOT_APPLIED.
EXTRA_NOT_APPLIED: dict[str, frozenset[str]] = {
    section: frozenset(path.split(".", 1)[1] for path in NOT_APPLIED_REASONS if path.startswith(section + "."))
    for section in {path.split(".", 1)[0] for path in NOT_APPLIED_REASONS}}

# ModelZoo keys of features not built here: refused, naming the feature. A key that becomes a
# field of its section (the model features of issue 21) is accepted instead and never looked up.
UNSUPPORTED: dict[str, str] = {
    "model.fixed_sparse_attention": "fixed sparse attention",
    "optimizer.max_gradient_value": "gradient clipping by value (max_gradient_value)",
    "model.lora_params": "LoRA adapters (lora_params)",
    "mixture.data_subset": "a subset of a mixture's data set (data_subset)",
}
# Values of known keys that name a feature not built here (checked only when the field
# itself refuses the value, so a schema that grows the feature accepts it).
UNSUPPORTED_VALUES: dict[tuple[str, Any], str] = {
    ("model.position_embedding_type", "fixed"): "fixed sinusoidal positions",
    ("model.position_embedding_type", "relative"): "relative position embeddings",
}
# Old spellings whose closest *name* is not their meaning; the hint names the right key.
HINTS: dict[str, str] = {
    "use_position_embedding": "position_embedding_type",
    "use_rms_norm": "norm_type",
    "beta1": "betas",
    "beta2": "betas",
    "epsilon": "eps",
    "use_bias_correction": "correct_bias",
    "steps": "total_iters",
}


def edit_distance(a: str, b: str) -> int:
    """Edits from ``a`` to ``b``: insertions, deletions, substitutions and swaps of two
    neighbouring characters (optimal string alignment)."""
    before, previous = None, list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char != other))
            if before is not None and j > 1 and char == b[j - 2] and a[i - 2] == other:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, previous = previous, current
    return previous[-1]


def _abbreviates(short: str, word: str) -> bool:
    letters = iter(word)
    return short[:1] == word[:1] and all(char in letters for char in short)


def same_spelling(key: str, candidate: str) -> bool:
    """Whether ``key`` is another spelling of ``candidate``: case and separators, a typo (one
    character in eight), or an abbreviation word by word of its leading words (batch_sz, hidden).
    Never another word: a hint must not lead to a key that means something else
    (residual_dropout_rate is not dropout_rate)."""
    def squashed(name: str) -> str:
        return name.lower().replace("_", "").replace("-", "")

    words, candidate_words = key.lower().split("_"), candidate.lower().split("_")
    return (squashed(key) == squashed(candidate) or edit_distance(key, candidate) <= max(1, len(candidate) // 8)
            or (len(words) <= len(candidate_words) and all(map(_abbreviates, words, candidate_words))))


def unknown_key_message(key: str, known: set[str], where: str) -> str:
    """Why ``where.key`` is refused: a feature not built here, or a key with the known key it
    misspells (an old spelling's meaning from HINTS); no hint when none has its meaning."""
    path = f"{where}.{key}"
    if path in UNSUPPORTED:
        return f"{path}: {UNSUPPORTED[path]} is not supported here"
    target = HINTS.get(key)
    if target not in known:
        spelled = [name for name in difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
                   if same_spelling(key, name)]
        target = spelled[0] if spelled else None
    hint = f"; did you mean {target!r}?" if target else ""
    return f"{path} is not a key of {where} (ModelZoo decoder LM schema){hint}"


def unsupported_value(section: type[BaseModel], where: str, key: str, value: Any) -> str | None:
    """The feature a refused value names, if the field does not accept it."""
    feature = UNSUPPORTED_VALUES.get((f"{where}.{key}", value)) if isinstance(value, str) else None
    field = section.model_fields.get(key)
    if feature is None or field is None:
        return None
    try:
        TypeAdapter(field.annotation).validate_python(value)
    except ValidationError:
        return f"{where}.{key}: {feature} is not supported here"
    return None


def _problem(kind: str, loc: tuple[Any, ...], message: str, value: Any) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError(kind, "{message}", {"message": message}),
                            loc=loc, input=value)


def validate_all_keys(cls: type[BaseModel], data: Any, handler: Any, known: set[str],
                      where: str, found: list[Problem] = ()) -> Any:
    """Validate ``data`` as ``cls``, reporting every unknown key *and* every field error of it
    together, after the ``found`` problems of an earlier step (pydantic stops at a failing
    before-validator, so unknown keys are set aside, the rest validated, and the lists joined)."""
    if not isinstance(data, dict):
        return handler(data)
    unknown = [key for key in data if key not in known]
    problems = [_problem("unknown_key", (key,), unknown_key_message(str(key), known, where), data[key])
                for key in unknown]
    problems += [_problem("not_supported", loc, message, None) for loc, message in found]
    try:
        result = handler({k: v for k, v in data.items() if k not in unknown})
    except ValidationError as err:
        for error in err.errors(include_url=False):
            key = error["loc"][0] if error["loc"] else None
            feature = unsupported_value(cls, where, key, data.get(key)) if isinstance(key, str) else None
            problems.append(_problem(error["type"], tuple(error["loc"]), feature or error["msg"],
                                     error.get("input")))
    if problems:
        raise ValidationError.from_exception_data(cls.__name__, problems)
    return result


def format_problems(err: ValidationError, title: str = "params") -> str:
    """All of a validation's problems as one message, each on its own line with its path."""
    lines = []
    for error in err.errors(include_url=False):
        path = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        lines.append(message if message.startswith(f"{path}:") or message.startswith(f"{path} ")
                     else f"{path}: {message}" if path else message)
    count = f"{len(lines)} problems" if len(lines) > 1 else "1 problem"
    return f"{count} in {title}:\n" + "\n".join(f"  - {line}" for line in lines)


def relocated(err: ValidationError, title: str, where: Any) -> ValidationError:
    """``err`` with each location mapped by ``where`` (a params path to the file's own path)."""
    return ValidationError.from_exception_data(title, [
        _problem(error["type"], where(tuple(error["loc"])), error["msg"], error.get("input"))
        for error in err.errors(include_url=False)])


class Section(BaseModel):
    """A params section: its fields, plus the hardware-only keys it accepts without applying
    (kept as pydantic extras, so the stored spec is the user's file)."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, validate_assignment=True)
    SECTION: ClassVar[str] = ""
    NOT_APPLIED: ClassVar[frozenset[str]] = frozenset()
    ALIASES: ClassVar[dict[str, str]] = {}  # another ModelZoo spelling -> field

    @model_validator(mode="wrap")
    @classmethod
    def _known_keys(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            data = rename_aliases(data, cls.ALIASES, prefix=f"{cls.SECTION}: ")
        return validate_all_keys(cls, data, handler, cls.known_keys(), cls.SECTION)

    @classmethod
    def known_keys(cls) -> set[str]:
        return (set(cls.model_fields) | cls.NOT_APPLIED | EXTRA_NOT_APPLIED.get(cls.SECTION, frozenset())
                | set(cls.ALIASES))

    def not_applied(self) -> dict[str, str]:
        """This section's keys accepted without effect here, each with the reason."""
        return {f"{self.SECTION}.{key}": NOT_APPLIED_REASONS.get(f"{self.SECTION}.{key}", HARDWARE_ONLY)
                for key in (self.model_extra or {})}
