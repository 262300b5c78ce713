"""Stored job specs in the current params layout: the first release's are converted.

The first release stored each job's spec in its own layout (`optimizer.type`,
`train_input.seq_len`, `model.n_layer`, a `warmup_cosine` learning rate); the ModelZoo schema
that replaced it refuses those keys, so after an upgrade every job not yet ended FAILED on
`optimizer.type is not a key of optimizer` and `:retry` of one answered 500. This revision
rewrites `jobs.params` and the `params` of `studies.request` from that layout into the
current one, meaning for meaning (the same model, optimizer and learning rate at every step),
and leaves specs already in the current layout as they are. The conversion is written out
here, not imported, so that it stays what it was when this revision was applied.

Downgrade keeps the converted specs: the first release's code cannot read them, and nothing
is lost by keeping them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 500
INPUT_RENAMES = {"seq_len": "max_sequence_length"}
MODEL_RENAMES = {"n_layer": "num_hidden_layers", "n_head": "num_heads", "d_model": "hidden_size",
                 "d_ff": "filter_size", "max_seq_len": "max_position_embeddings",
                 "tie_embeddings": "share_embedding_weights"}
# The first release's model whatever its sizes: a Llama (RoPE, RMSNorm, SwiGLU, no biases),
# which the current schema calls so only through a preset; without one it is ModelZoo's GPT-2.
FIRST_RELEASE_MODEL = {"position_embedding_type": "rotary", "norm_type": "rmsnorm",
                       "nonlinearity": "swiglu", "use_projection_bias_in_attention": False,
                       "use_ffn_bias_in_attention": False, "use_ffn_bias": False,
                       "share_embedding_weights": True, "dropout_rate": 0.0,
                       "attention_dropout_rate": 0.0, "layer_norm_epsilon": 1e-5,
                       "rope_theta": 10000.0, "vocab_size": 256}  # (the data's decides)


def is_first_release(params: Any) -> bool:
    """Its optimizer names its class `type` (the current layout: `optimizer_type`)."""
    optimizer = params.get("optimizer") if isinstance(params, dict) else None
    return isinstance(optimizer, dict) and "type" in optimizer and "optimizer_type" not in optimizer


def convert(params: dict[str, Any]) -> dict[str, Any]:
    """A first-release spec in the current layout (unset keys dropped: the defaults were the
    same, and the first release stored every key)."""
    out = dict(params)
    for section in ("train_input", "eval_input"):
        if isinstance(out.get(section), dict):
            out[section] = _renamed(out[section], INPUT_RENAMES)
    if isinstance(out.get("model"), dict):
        model = _renamed(out["model"], MODEL_RENAMES)
        if model.get("preset") is None:
            model = {**FIRST_RELEASE_MODEL, **{k: v for k, v in model.items() if k != "preset"}}
        out["model"] = model
    runconfig = out.get("runconfig") if isinstance(out.get("runconfig"), dict) else {}
    optimizer = _renamed(out["optimizer"], {"type": "optimizer_type"})
    rate = optimizer.get("learning_rate")
    if isinstance(rate, dict) and rate.get("type") == "warmup_cosine":
        optimizer["learning_rate"] = schedulers(rate, int(runconfig.get("max_steps") or 100))
    out["optimizer"] = optimizer
    return out


def schedulers(rate: dict[str, Any], max_steps: int) -> list[dict[str, Any]]:
    """The first release's warm-up + cosine as cstorch schedulers giving the same rate at
    every step: (step + 1) / warmup_steps of the peak while warming up, then cosine from the
    peak to `minimum` at `decay_steps` (default max_steps), then `minimum`."""
    peak, minimum = float(rate["peak"]), float(rate.get("minimum") or 0.0)
    warmup = int(rate.get("warmup_steps") or 0)
    decay = int(rate.get("decay_steps") or max_steps)
    phases: list[dict[str, Any]] = []
    if warmup:
        phases.append({"scheduler": "Linear", "initial_learning_rate": peak / warmup,
                       "end_learning_rate": peak * (warmup + 1) / warmup, "total_iters": warmup})
    if decay > warmup:
        phases.append({"scheduler": "CosineDecay", "initial_learning_rate": peak,
                       "end_learning_rate": minimum, "total_iters": decay - warmup})
    else:
        phases.append({"scheduler": "Constant", "learning_rate": minimum})
    return phases


def _renamed(section: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    out = {}
    for key, value in section.items():
        if key in renames:
            if value is not None:
                out[renames[key]] = value
        else:
            out[key] = value
    return out


def upgrade() -> None:
    connection = op.get_bind()
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("params", sa.JSON))
    studies = sa.table("studies", sa.column("id", sa.Integer), sa.column("request", sa.JSON))
    for table, column, spec_of in ((jobs, jobs.c.params, lambda value: value),
                                   (studies, studies.c.request,
                                    lambda value: (value or {}).get("params"))):
        last = 0
        while rows := connection.execute(
                sa.select(table.c.id, column).where(table.c.id > last)
                .order_by(table.c.id).limit(BATCH)).all():
            last = rows[-1][0]
            for row_id, value in rows:
                spec = spec_of(value)
                if not is_first_release(spec):
                    continue
                converted = convert(spec)
                new = converted if table is jobs else {**value, "params": converted}
                connection.execute(table.update().where(table.c.id == row_id)
                                   .values({column.name: new}))


def downgrade() -> None:
    pass
