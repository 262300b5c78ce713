"""Request and response schemas, named by the boundary they cross (Create, Public, Page)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    StringConstraints,
    field_validator,
    model_validator,
)

from csx_config import JobSpec, batch_split_problem, with_overrides

# Ids are `integer` columns: 32-bit on PostgreSQL. A larger id cannot exist, so it is a 422
# (PostgreSQL refused to compare one: a 500).
MAX_ID = 2**31 - 1
Mode = Literal["train", "eval", "train_and_eval", "eval_all"]
StudyAlgorithm = Literal["dense", "static", "set", "rigl", "granet"]
# No NUL characters: PostgreSQL cannot store them in text (bodies are checked for them anywhere
# before validation; the pattern documents it).
NO_NUL = r"^[^\x00]*$"
MAX_NAME_CHARS = 200  # names and experiments: String(200) columns
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS,
                                        strip_whitespace=True, pattern=NO_NUL)]
TagKey = Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=NO_NUL)]
TagValue = Annotated[str, StringConstraints(max_length=1000, pattern=NO_NUL)]


class CheckpointRef(BaseModel):
    """A checkpoint of a job the caller can see; the service resolves it to the file."""

    model_config = ConfigDict(extra="forbid")

    job: int = Field(ge=1, le=MAX_ID)
    step: int | None = Field(default=None, ge=0, le=2**63 - 1, description="default: newest")


class RunOptions(BaseModel):
    """What a job needs besides its params; also the extra top-level keys of a YAML body."""

    model_config = ConfigDict(extra="forbid")

    num_csx: int | None = Field(default=None, ge=1, description="default: runconfig.num_csx or 1")
    mode: Mode = "train"
    experiment: Name | None = None
    priority: int = Field(default=0, ge=-1000, le=1000, description="higher starts first")
    max_failures: int | None = Field(
        default=None, ge=0, le=100, description="worker failures recovered; default runconfig's"
    )
    timeout_s: float | None = Field(default=None, gt=0, le=30 * 86400, allow_inf_nan=False)
    tags: dict[TagKey, TagValue] = Field(default_factory=dict, max_length=50)
    overrides: list[Annotated[str, StringConstraints(max_length=1000)]] = Field(
        default_factory=list, max_length=100,
        description="`section.key=value` (or `~section.key` to remove a key) applied to params "
                    "first, as `csx run --set` / `--unset` do")

    @model_validator(mode="before")
    @classmethod
    def _apply_overrides(cls, data: Any) -> Any:
        overrides = data.get("overrides") if isinstance(data, dict) else None
        if (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)
                and isinstance(data.get("params"), dict)):
            return {**data, "params": with_overrides(data["params"], overrides)}
        return data
    checkpoint: CheckpointRef | None = Field(
        default=None, description="start (train) or evaluate (eval) from this job's checkpoint")


class JobCreate(RunOptions):
    name: Name | None = None
    params: JobSpec


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    experiment: str
    owner: str
    status: str
    status_message: str | None
    attempt: int
    failures: int
    max_failures: int
    queue_position: int | None
    num_csx: int
    mode: str
    priority: int
    timeout_s: float | None
    tags: dict[str, str]
    systems: list[int]
    study_id: int | None
    mlflow_run_id: str | None
    mlflow_url: str | None
    progress: dict[str, Any] | None
    result: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobDetail(JobPublic):
    params: dict[str, Any]
    plan: dict[str, Any] | None


class JobsPage(BaseModel):
    data: list[JobPublic]
    count: int
    next_cursor: int | None = Field(description="?cursor= for the next page; null at the end")


class JobEventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    from_status: str | None
    to_status: str
    message: str | None
    attempt: int
    at: datetime


class JobEventsPage(BaseModel):
    data: list[JobEventPublic]
    count: int


class ValidationPublic(BaseModel):
    valid: bool
    num_csx: int
    plan: dict[str, Any]


class StudyVariant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    sparsity: Any = Field(description="the variant's `sparsity` section; null for dense")
    # Sparse runs at half the batch for twice the steps (In-Time Over-Parameterization, as the
    # Cerebras sparsity blog trains them): the tokens stay the base's, so variants stay comparable.
    batch_size: PositiveInt | None = Field(
        default=None, description="this variant's train_input.batch_size; with max_steps, "
                                  "batch_size x max_steps must equal the base's (same tokens), "
                                  "and either one alone derives the other")
    max_steps: PositiveInt | None = Field(
        default=None, description="this variant's runconfig.max_steps; the learning-rate "
                                  "schedule and the eval/checkpoint/log cadence stretch with it")

    def with_equal_tokens(self, base_batch: int, base_steps: int, num_csx: int,
                          where: str) -> StudyVariant:
        """This variant with both batch_size and max_steps set (or neither), so that it trains
        on the base's tokens; ValueError names the field (`where` is the variant's path)."""
        if self.batch_size is None and self.max_steps is None:
            return self
        tokens = base_batch * base_steps
        batch = self.batch_size or tokens // self.max_steps
        steps = self.max_steps or tokens // self.batch_size
        if batch * steps != tokens:
            field = "batch_size" if self.batch_size is not None else "max_steps"
            raise ValueError(
                f"{where}.{field}: batch_size {batch} x max_steps {steps} must equal the base's "
                f"{base_batch} x {base_steps} = {tokens} sequences (every variant trains on the "
                "same tokens)")
        if split := batch_split_problem(batch, num_csx, where):
            raise ValueError(split)
        return self.model_copy(update={"batch_size": batch, "max_steps": steps})


def _study_schema(schema: dict[str, Any]) -> None:
    """The rules of _one_way_to_name_variants that JSON Schema can say, so a body the schema
    allows is one the service accepts: exactly one of `algorithms` and `variants` (neither
    null), and `sparsity` whenever `algorithms` lists more than dense."""
    properties = schema["properties"]
    for key in ("algorithms", "variants"):
        properties[key] = next(s for s in properties[key]["anyOf"] if s.get("type") != "null")
    properties["algorithms"]["uniqueItems"] = True
    properties["seeds"]["anyOf"][0]["uniqueItems"] = True
    properties["sparsity"]["anyOf"][0].update(exclusiveMinimum=0, exclusiveMaximum=1)
    properties["algorithm_options"]["anyOf"][0]["not"] = {"required": ["dense"]}
    sparse = {"contains": {"not": {"const": "dense"}}}
    schema["oneOf"] = [
        {"required": ["variants"], "not": {"required": ["algorithms"]}},
        {"required": ["algorithms"], "not": {"required": ["variants"]},
         "anyOf": [{"properties": {"algorithms": {"not": sparse}}},
                   {"required": ["sparsity"], "properties": {"sparsity": {"type": "number"}}}]},
    ]


class StudyCreate(RunOptions):
    model_config = ConfigDict(json_schema_extra=_study_schema)

    name: Name
    mode: Mode = "train_and_eval"  # a study compares eval perplexities
    params: JobSpec
    algorithms: list[StudyAlgorithm] | None = Field(default=None, min_length=1, max_length=16)
    sparsity: float | None = Field(default=None, description="target level for `algorithms`")
    variants: list[StudyVariant] | None = Field(default=None, min_length=1, max_length=16)
    algorithm_options: dict[StudyAlgorithm, dict[str, Any]] | None = Field(
        default=None, description="keys added to the sparsity section the service derives for "
                                  "an algorithm of `algorithms`, e.g. {rigl: {balance_out_groups: 32}}")
    seeds: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        default=None, min_length=1, max_length=10,
        description="run every variant once per seed (as runconfig.seed); the report gives "
                    "mean ± sd per variant and which gaps exceed seed noise")

    @field_validator("algorithms", "variants", mode="before")
    @classmethod
    def _absent_not_null(cls, value: Any) -> Any:
        if value is None:  # only an explicit null reaches here: defaults are not validated
            raise ValueError("leave it out instead of null")
        return value

    @field_validator("sparsity")
    @classmethod
    def _level_in_range(cls, value: float | None) -> float | None:
        if value is not None and (math.isnan(value) or not 0 < value < 1):
            raise ValueError(f"sparsity must be in (0, 1), got {value}")
        return value

    @model_validator(mode="after")
    def _one_way_to_name_variants(self) -> StudyCreate:
        if (self.algorithms is None) == (self.variants is None):
            raise ValueError("give exactly one of `algorithms` (with `sparsity`) or `variants`")
        if self.algorithms is not None:
            if len(set(self.algorithms)) != len(self.algorithms):
                raise ValueError(f"algorithms must be distinct, got {self.algorithms}")
            if self.sparsity is None and set(self.algorithms) != {"dense"}:
                raise ValueError("`algorithms` other than dense need `sparsity`")
        if self.variants is not None:
            if len({v.name for v in self.variants}) != len(self.variants):
                raise ValueError("variant names must be distinct")
            run = self.params.runconfig
            num_csx = self.num_csx if self.num_csx is not None else run.num_csx
            self.variants = [v.with_equal_tokens(self.params.train_input.batch_size, run.max_steps,
                                                 num_csx, f"variants[{i}] ({v.name})")
                             for i, v in enumerate(self.variants)]
        if "dense" in (self.algorithm_options or {}):  # options of unlisted algorithms: unused
            raise ValueError("algorithm_options.dense: dense has no sparsity section to extend")
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        return self


class StudyPublic(BaseModel):
    id: int
    name: str
    experiment: str
    status: str = Field(description="RUNNING until every job is terminal, then DONE")
    mlflow_run_id: str | None
    mlflow_url: str | None
    created_at: datetime
    jobs: list[JobPublic]


class StudyReportRow(BaseModel):
    job_id: int
    variant: str
    status: str
    final_eval_perplexity: float | None
    best_eval_perplexity: float | None
    projected_speedup: float | None
    wall_time_s: float | None
    seed: int | None = None


class StudyVariantSummary(BaseModel):
    variant: str
    runs: int = Field(description="runs with a final eval perplexity (one per seed)")
    final_eval_perplexity_mean: float | None
    final_eval_perplexity_sd: float | None = Field(description="sample sd over seeds; null below 2 runs")
    projected_speedup_mean: float | None


class StudyGap(BaseModel):
    better: str = Field(description="the variant with the lower mean final perplexity")
    worse: str
    gap: float = Field(description="mean final perplexity of `worse` minus that of `better`")
    noise: float | None = Field(description="the larger of the two seed-to-seed sds; null "
                                            "when a side has 1 run (no noise estimate)")
    exceeds_noise: bool | None = Field(description="gap > noise; null when `noise` is")
    verdict: str = Field(description="'real' (beyond seed noise), 'within seed noise' or "
                                     "'1 seed: no noise estimate'")
    published: Literal["agrees", "disagrees"] | None = Field(
        description="against Cerebras' published order of this pair at 80%; null if unpublished")


class StudyProjection(BaseModel):
    variant: str
    model: str = Field(description="which model the numbers are for")
    num_csx: int
    step_ms: float
    speedup_vs_dense: float


class StudyReport(BaseModel):
    study_id: int
    complete: bool
    rows: list[StudyReportRow]
    variants: list[StudyVariantSummary] = Field(default_factory=list, description="over seeds")
    gaps: list[StudyGap] = Field(default_factory=list, description="every pair of variants")
    full_size: list[StudyProjection] = Field(
        default_factory=list, description="CS-2 projection of the full-size model when the "
                                          "study trains a scaled-down proxy of it")
    png_base64: str | None = Field(description="perplexity curves, PNG; null before any eval")


class ClusterSystem(BaseModel):
    id: int
    job_id: int | None


class ClusterPublic(BaseModel):
    size: int
    free: int
    paused: bool
    queued: int
    systems: list[ClusterSystem]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    database: str = Field(description='"ok", or "unavailable: <the error>"')
    scheduler: Literal["running", "standby", "stalled", "stopped"]


class MlflowCredentials(BaseModel):
    username: str
    password: str
    url: str = Field(description="the MLflow UI: sign in there with these credentials")
