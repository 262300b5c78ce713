"""ModelZoo learning-rate schedulers (``optimizer.learning_rate``), as data and as a function.

``learning_rate`` is a number (constant), one scheduler, or a list of schedulers run one after
another, each for its ``total_iters`` steps (the last one holds its final value afterwards)::

    learning_rate:
      - {scheduler: Linear, initial_learning_rate: 0.0, end_learning_rate: 6.0e-4, total_iters: 716}
      - {scheduler: CosineDecay, initial_learning_rate: 6.0e-4, end_learning_rate: 6.0e-5, total_iters: 4062}

Names follow cstorch (``Linear`` or ``LinearLR``, any case). ``decay_steps`` and ``steps`` (ModelZoo
1.x) are accepted for ``total_iters``. Imports only pydantic: the service validates schedules
without torch, and the training loop uses ``learning_rate_at`` through a ``LambdaLR``.
"""

from __future__ import annotations

import difflib
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

# scheduler -> (required keys, optional keys with their cstorch defaults)
SCHEDULERS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "constant": (("learning_rate",), {"total_iters": None}),
    "linear": (("initial_learning_rate", "end_learning_rate", "total_iters"), {}),
    "cosinedecay": (("initial_learning_rate", "end_learning_rate", "total_iters"), {}),
    "exponential": (("initial_learning_rate", "total_iters", "decay_rate"), {"staircase": False}),
    "polynomial": (("initial_learning_rate", "end_learning_rate", "total_iters"),
                   {"power": 1.0, "cycle": False}),
    "inversesquarerootdecay": ((), {"initial_learning_rate": 1.0, "scale": 1.0, "warmup_steps": 1.0}),
    "step": (("initial_learning_rate", "step_size", "gamma"), {}),
    "multistep": (("initial_learning_rate", "gamma", "milestones"), {}),
    "cosineannealing": (("initial_learning_rate", "T_max"), {"eta_min": 0.0}),
}
_TOTAL_ITERS_ALIASES = ("decay_steps", "steps")
# The cstorch class each scheduler is stored as, so 'Linear' and 'linear_lr' make one spec.
CLASS_NAMES = {"constant": "ConstantLR", "linear": "LinearLR", "cosinedecay": "CosineDecayLR",
               "exponential": "ExponentialLR", "polynomial": "PolynomialLR",
               "inversesquarerootdecay": "InverseSquareRootDecayLR", "step": "StepLR",
               "multistep": "MultiStepLR", "cosineannealing": "CosineAnnealingLR"}


def scheduler_key(name: str) -> str:
    """'CosineDecayLR', 'cosine_decay' and 'CosineDecay' all name the same scheduler."""
    key = name.lower().replace("_", "")
    return key.removesuffix("lr") if key.removesuffix("lr") in SCHEDULERS else key


def rename_aliases(data: dict[str, Any], aliases: dict[str, str], prefix: str = "") -> dict[str, Any]:
    """A copy of ``data`` with each alias key (another ModelZoo spelling) renamed to its field;
    giving both spellings is an error (``prefix`` says where)."""
    data = dict(data)
    for alias, name in aliases.items():
        if alias in data:
            if name in data:
                raise ValueError(f"{prefix}give {name} or {alias}, not both")
            data[name] = data.pop(alias)
    return data


class SchedulerSpec(BaseModel):
    """One cstorch scheduler: its name and the numbers that scheduler takes (and only those)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    scheduler: str
    learning_rate: float | None = Field(None, ge=0.0)
    initial_learning_rate: float | None = Field(None, ge=0.0)
    end_learning_rate: float | None = Field(None, ge=0.0)
    total_iters: int | None = Field(None, ge=1)
    decay_rate: float | None = Field(None, gt=0.0)
    staircase: bool | None = None
    power: float | None = None
    cycle: bool | None = None
    scale: float | None = None
    warmup_steps: float | None = Field(None, ge=1.0)
    step_size: int | None = Field(None, ge=1)
    gamma: float | None = Field(None, gt=0.0)
    milestones: list[int] | None = None
    T_max: int | None = Field(None, ge=1)  # noqa: N815 (cstorch's name)
    eta_min: float | None = Field(None, ge=0.0)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return rename_aliases(data, {alias: "total_iters" for alias in _TOTAL_ITERS_ALIASES})

    @model_validator(mode="after")
    def _keys_of_this_scheduler(self) -> SchedulerSpec:
        key = scheduler_key(self.scheduler)
        if key not in SCHEDULERS:
            close = difflib.get_close_matches(key, list(SCHEDULERS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown scheduler {self.scheduler!r}{hint}; choose one of "
                             f"{sorted(SCHEDULERS)} (an 'LR' suffix is allowed)")
        required, optional = SCHEDULERS[key]
        given = {k for k, v in self if v is not None and k != "scheduler"}
        if key == "constant" and "learning_rate" not in given and "initial_learning_rate" in given:
            self.learning_rate, self.initial_learning_rate = self.initial_learning_rate, None
            given = (given - {"initial_learning_rate"}) | {"learning_rate"}
        missing = [k for k in required if k not in given]
        extra = sorted(given - set(required) - set(optional))
        if missing:
            raise ValueError(f"scheduler {self.scheduler!r} needs {', '.join(missing)}")
        if extra:
            raise ValueError(f"scheduler {self.scheduler!r} does not take {', '.join(extra)}")
        self.scheduler = CLASS_NAMES[key]
        return self

    def is_constant(self) -> bool:
        """A constant rate for the whole run: the same job as a plain number."""
        return scheduler_key(self.scheduler) == "constant" and self.total_iters is None

    def value(self, name: str) -> Any:
        given = getattr(self, name)
        return SCHEDULERS[scheduler_key(self.scheduler)][1].get(name) if given is None else given

    def rate(self, step: int) -> float:
        """The learning rate ``step`` steps into this scheduler (cstorch's formulas)."""
        key, v = scheduler_key(self.scheduler), self.value
        total = v("total_iters")
        t = min(step, total) if total else step
        if key == "constant":
            return v("learning_rate")
        if key == "linear":
            return v("initial_learning_rate") + (v("end_learning_rate") - v("initial_learning_rate")) * t / total
        if key == "cosinedecay":
            start, end = v("initial_learning_rate"), v("end_learning_rate")
            return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t / total))
        if key == "exponential":
            power = step / total
            return v("initial_learning_rate") * v("decay_rate") ** (math.floor(power) if v("staircase") else power)
        if key == "polynomial":
            start, end = v("initial_learning_rate"), v("end_learning_rate")
            if v("cycle"):
                total = total * max(1, math.ceil(step / total))
                t = step
            return end + (start - end) * (1.0 - t / total) ** v("power")
        if key == "inversesquarerootdecay":
            return v("initial_learning_rate") * v("scale") / math.sqrt(max(step, v("warmup_steps")))
        if key == "step":
            return v("initial_learning_rate") * v("gamma") ** (step // v("step_size"))
        if key == "multistep":
            return v("initial_learning_rate") * v("gamma") ** sum(step >= m for m in v("milestones"))
        t_max = v("T_max")  # cosineannealing, periodic like torch's closed form
        start, floor = v("initial_learning_rate"), v("eta_min")
        return floor + (start - floor) * 0.5 * (1.0 + math.cos(math.pi * (step % (2 * t_max)) / t_max))


def _rate_form(value: Any) -> str:
    """Which form a learning_rate is written in, so a bad one is checked as that form only."""
    if isinstance(value, (list, tuple)):
        return "schedulers"
    return "scheduler" if isinstance(value, (dict, SchedulerSpec)) else "number"


LearningRate = Annotated[
    Annotated[float, Tag("number")] | Annotated[SchedulerSpec, Tag("scheduler")]
    | Annotated[list[SchedulerSpec], Tag("schedulers")],
    Discriminator(_rate_form)]


def check_sequence(schedulers: list[SchedulerSpec]) -> None:
    """Every scheduler but the last must say how long it runs."""
    if not schedulers:
        raise ValueError("learning_rate: an empty scheduler list")
    for index, item in enumerate(schedulers[:-1]):
        if item.total_iters is None:
            raise ValueError(f"learning_rate[{index}] ({item.scheduler}) needs total_iters: "
                             "a scheduler followed by another must say how many steps it runs")


def warmup_steps(rate: LearningRate) -> int:
    """The steps of a leading linear ramp-up (ModelZoo's warm-up phase); 0 without one."""
    first = rate[0] if isinstance(rate, list) else rate
    if (isinstance(first, SchedulerSpec) and scheduler_key(first.scheduler) == "linear"
            and first.value("end_learning_rate") > first.value("initial_learning_rate")):
        return first.value("total_iters")
    return 0


def learning_rate_at(rate: LearningRate, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based: the first step uses step 0)."""
    if isinstance(rate, (int, float)):
        return float(rate)
    schedulers = rate if isinstance(rate, list) else [rate]
    start = 0
    for item in schedulers[:-1]:
        if step < start + item.total_iters:
            return item.rate(step - start)
        start += item.total_iters
    return schedulers[-1].rate(step - start)
