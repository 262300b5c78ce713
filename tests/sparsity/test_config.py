"""configure(): both ModelZoo layouts, legacy keys, groups, registry and error messages."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import sparsity
from sparsity.config import configure, configure_sparsity_wrapper
from sparsity.masks import keep_count, topk_mask


class TinyLM(nn.Module):
    """Every kind of parameter the default filter must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 8)
        self.lm_head = nn.Linear(8, 10, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.fc2(self.norm(torch.relu(self.fc1(self.embedding(tokens))))))


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """``<param>`` → mask, read from the model's buffers (whatever built them)."""
    return {
        name[: -len("_mask")]: buf.clone()
        for name, buf in model.named_buffers()
        if name.endswith("_mask")
    }


def train(model: nn.Module, alg: object, steps: int) -> list[dict[str, torch.Tensor]]:
    """A few SGD steps on fixed data; the masks after each step."""
    alg.apply(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(optimizer)
    generator = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        tokens = torch.randint(0, 10, (4, 3), generator=generator)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 10), tokens.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(masks(model))
    return history


def sparsity_of(mask: torch.Tensor) -> float:
    return 1.0 - mask.sum().item() / mask.numel()


# --------------------------------------------------------------------------- shapes of config
def test_float_is_static_under_default_filter() -> None:
    alg = configure(0.75)
    assert isinstance(alg, sparsity.Static)
    model = make_model()
    alg.apply(model)
    found = masks(model)
    # embedding, norm, lm_head and every bias stay dense
    assert sorted(found) == ["fc1.weight", "fc2.weight"]
    for mask in found.values():
        assert int(mask.sum()) == keep_count(mask.numel(), 0.75)


def test_param_filter_argument_replaces_the_default() -> None:
    model = make_model()
    configure(0.5, param_filter="fc2.weight").apply(model)
    assert sorted(masks(model)) == ["fc2.weight"]


def test_config_own_filter_wins_over_the_argument() -> None:
    model = make_model()
    configure({"sparsity": 0.5, "param_filter": "fc1.weight"}, param_filter="fc2.weight").apply(model)
    assert sorted(masks(model)) == ["fc1.weight"]


# ----------------------------------------------------------------- 2.x layout == legacy layout
LAYOUT_PAIRS = {
    "static-sideband-regex": (
        {"algorithm": "static", "sparsity": 0.75, "param_filter": ["fc1.weight", "fc2.weight"], "seed": 3},
        {"type": "sideband", "sparsity": 0.75, "param_name_patterns": r"fc\d\.weight", "seed": 3},
    ),
    "schedule-alias-of-sparsity": (
        {"algorithm": "static", "sparsity": 0.5, "init_method": "topk"},
        {"type": "static", "schedule": 0.5, "init_method": "topk"},
    ),
    "sparsity_schedule-piecewise": (
        {
            "algorithm": "gmp",
            "sparsity": {"type": "piecewiseconstant", "points": [[0, 0.25], [2, 0.5], [3, 0.75]]},
            "update": {"steps": [2, 3]},
        },
        {"type": "gmp", "sparsity_schedule": [[0, 0.25], [2, 0.5], [3, 0.75]]},
    ),
    "schedule-int-cadence": (
        {"algorithm": "gmp", "sparsity": {"type": "linear", "init": 0.25, "slope": 0.1}, "update": {"freq": 2}},
        {"type": "gmp", "sparsity": {"type": "linear", "init": 0.25, "slope": 0.1}, "schedule": 2},
    ),
    "schedule-dict-cadence": (
        {"algorithm": "set", "sparsity": 0.5, "update": {"freq": 1, "start": 1, "stop": 3}, "seed": 7},
        {"type": "set", "sparsity": 0.5, "schedule": {"freq": 1, "start": 1, "stop": 3}, "seed": 7},
    ),
}


@pytest.mark.parametrize("new, legacy", LAYOUT_PAIRS.values(), ids=LAYOUT_PAIRS.keys())
def test_both_layouts_give_the_same_masks(new: dict, legacy: dict) -> None:
    new_history = train(make_model(), configure(new), steps=4)
    legacy_history = train(make_model(), configure(legacy), steps=4)
    assert sorted(new_history[0]) == ["fc1.weight", "fc2.weight"]
    for new_masks, legacy_masks in zip(new_history, legacy_history, strict=True):
        for name, mask in new_masks.items():
            assert torch.equal(mask, legacy_masks[name]), name
            assert 0 < mask.sum() < mask.numel()


def test_sparsity_schedule_updates_at_its_boundaries() -> None:
    history = train(make_model(), configure({"type": "gmp", "sparsity_schedule": [[0, 0.25], [2, 0.5]]}), 3)
    levels = [sparsity_of(step["fc1.weight"]) for step in history]
    assert levels == [0.25, 0.5, 0.5]


def test_sparsity_schedule_with_static_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sparsity_schedule.*\[5\].*static"):
        configure({"type": "static", "sparsity_schedule": [[0, 0.25], [5, 0.5]]})


@pytest.mark.parametrize(
    "schedule, update_steps",
    [(3, [3, 6]), ({"freq": 2, "start": 2, "stop": 6}, [2, 4]), ({"steps": [5]}, [5])],
    ids=["int", "freq-start-stop", "steps"],
)
def test_legacy_schedule_as_cadence(schedule: object, update_steps: list[int]) -> None:
    alg = configure({"type": "gmp", "sparsity": 0.5, "schedule": schedule})
    assert [t for t in range(1, 8) if alg.is_update_step(t)] == update_steps


@pytest.mark.parametrize(
    "schedule",
    [0.5, 0, {"type": "constant", "value": 0.5}, [0.25, 0.5], lambda step: 0.5],
    ids=["float", "int-zero", "typed-dict", "cycling-list", "callable"],
)
def test_legacy_schedule_as_sparsity(schedule: object) -> None:
    alg = configure({"type": "gmp", "schedule": schedule, "update": 1})
    assert alg.target_sparsity(0) == (0.0 if schedule == 0 else 0.25 if isinstance(schedule, list) else 0.5)


def test_schedule_and_sparsity_together_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\['schedule', 'sparsity'\].*keep one"):
        configure({"sparsity": 0.5, "schedule": 0.25})
    with pytest.raises(ValueError, match=r"\['schedule', 'update'\].*keep one"):
        configure({"type": "gmp", "sparsity": 0.5, "schedule": 2, "update": 2})


# ----------------------------------------------------------------------- param_name_patterns
def test_regex_patterns_use_search_semantics() -> None:
    model = make_model()
    configure({"sparsity": 0.5, "param_name_patterns": "fc"}).apply(model)
    # "fc" is found inside every fc name; an explicit filter may select biases too
    assert sorted(masks(model)) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    model = make_model()
    configure({"sparsity": 0.5, "param_filter": "fc"}).apply(model)  # globs match the full name
    assert masks(model) == {}


def test_regex_pattern_list() -> None:
    model = make_model()
    configure({"sparsity": 0.5, "param_name_patterns": [r"fc1\.weight$", r"^lm_head"]}).apply(model)
    assert sorted(masks(model)) == ["fc1.weight", "lm_head.weight"]


def test_pattern_dict_makes_one_group_per_pattern_with_overrides() -> None:
    config = {
        "type": "static",
        "sparsity": 0.5,
        "seed": 2,
        "param_name_patterns": {r"fc1\.weight": {"sparsity": 0.25}, r"fc2\.weight": None, "lm_head": 0.75},
    }
    alg = configure(config)
    assert isinstance(alg, sparsity.Group)
    model = make_model()
    alg.apply(model)
    levels = {name: sparsity_of(mask) for name, mask in masks(model).items()}
    assert levels == {"fc1.weight": 0.25, "fc2.weight": 0.5, "lm_head.weight": 0.75}


# --------------------------------------------------------------------------------- groups
GROUPS = [
    {"param_filter": "fc1.*", "sparsity": 0.25},
    {"param_filter": ["fc*.weight", "lm_head.weight"], "sparsity": 0.5},
]


@pytest.mark.parametrize(
    "config",
    [GROUPS, {"groups": GROUPS}],
    ids=["list", "groups-key"],
)
def test_groups_first_match_wins(config: object) -> None:
    alg = configure(config)
    assert isinstance(alg, sparsity.Group)
    model = make_model()
    alg.apply(model)
    levels = {name: sparsity_of(mask) for name, mask in masks(model).items()}
    # fc1.weight also matches the second group's "fc*.weight"; the first group claims it
    assert levels == {"fc1.weight": 0.25, "fc1.bias": 0.25, "fc2.weight": 0.5, "lm_head.weight": 0.5}


def test_groups_key_defaults_apply_to_each_group() -> None:
    model = make_model()
    groups = [{"param_filter": "fc1.weight"}, {"param_filter": "fc2.weight"}]
    configure({"groups": groups, "sparsity": 0.75}).apply(model)
    assert {name: sparsity_of(mask) for name, mask in masks(model).items()} == {
        "fc1.weight": 0.75,
        "fc2.weight": 0.75,
    }


def test_group_without_filter_takes_the_default_filter() -> None:
    model = make_model()
    configure([{"param_filter": "fc1.weight", "sparsity": 0.25}, {"sparsity": 0.75}]).apply(model)
    assert {name: sparsity_of(mask) for name, mask in masks(model).items()} == {
        "fc1.weight": 0.25,
        "fc2.weight": 0.75,
    }


# ------------------------------------------------------------------------ algorithm specifics
def test_algorithm_specific_keys_pass_through() -> None:
    alg = configure(
        {"algorithm": "granet", "sparsity": 0.8, "init_sparsity": 0.5, "pruning": "layer",
         "update": {"freq": 100, "stop": 3000}}
    )
    assert isinstance(alg, sparsity.GraNet)
    assert alg.pruning == "layer"
    assert alg.target_sparsity(0) == pytest.approx(0.5)
    assert alg.target_sparsity(3000) == pytest.approx(0.8)


def test_rigl_keys() -> None:
    alg = configure(
        {"algorithm": "RigL", "sparsity": 0.8, "update": {"freq": 100, "stop": 3000},
         "drop_fraction": {"type": "cosine", "init": 0.3, "half_period": 3000}, "balance_out_groups": 2}
    )
    assert isinstance(alg, sparsity.RigL)
    assert alg.drop_fraction(1500) == pytest.approx(0.15)


class ConfigTestCustom(sparsity.DynamicSparsityAlgorithm):
    """A user algorithm: keeps the largest |w| and remembers a knob of its own."""

    def __init__(self, sparsity: object = None, *, knob: int = 1, **kwargs: object) -> None:
        super().__init__(sparsity, **kwargs)
        self.knob = knob

    def update_mask(self, p: torch.nn.Parameter, mask: torch.Tensor, level: float) -> torch.Tensor:
        return topk_mask(p.detach().abs().reshape(1, -1), keep_count(p.numel(), level)).reshape(p.shape)


def test_registered_custom_algorithm_is_configurable() -> None:
    alg = configure({"algorithm": "ConfigTestCustom", "sparsity": 0.5, "update": 2, "knob": 7})
    assert isinstance(alg, ConfigTestCustom)
    assert alg.knob == 7
    model = make_model()
    after_update = train(model, alg, steps=2)[-1]["fc1.weight"]
    magnitude = model.fc1.weight.detach().abs()
    assert int(after_update.sum()) == 64
    assert torch.equal(after_update, magnitude >= magnitude.flatten().kthvalue(65).values)
    with pytest.raises(ValueError, match=r"'knobs'.*allowed:.*'knob'"):
        configure({"algorithm": "configtestcustom", "sparsity": 0.5, "knobs": 7})


def test_wrapper_is_a_drop_in_optimizer_over_the_hooked_one() -> None:
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizer = configure_sparsity_wrapper(model, inner, {"sparsity": 0.5})
    assert isinstance(optimizer, torch.optim.Optimizer) and optimizer.param_groups is inner.param_groups
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    assert "sparsity" in optimizer.state_dict() and optimizer.state is inner.state
    for name, mask in masks(model).items():
        weight = model.get_parameter(name)
        assert torch.all(weight[~mask] == 0) and weight[mask].ne(0).all()


# ------------------------------------------------------------------------------- errors
def test_unknown_key_names_it_and_the_allowed_ones() -> None:
    expected = r"unknown key\(s\) \['drop_fraction'\] for algorithm 'static'; allowed:.*'init_method'"
    with pytest.raises(ValueError, match=expected):
        configure({"algorithm": "static", "sparsity": 0.5, "drop_fraction": 0.3})


def test_unknown_algorithm_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'magic'.*known:.*'gmp'.*'rigl'.*'static'"):
        configure({"algorithm": "magic", "sparsity": 0.5})


@pytest.mark.parametrize("key", ["sparsity", "drop_fraction"])
def test_unknown_schedule_type_names_key_and_known_types(key: str) -> None:
    config = {"algorithm": "set", "sparsity": 0.5, "update": 1, key: {"type": "wobble"}}
    with pytest.raises(ValueError, match=rf"sparsity\.{key}: unknown schedule type 'wobble'.*'cosine'"):
        configure(config)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"sparsity": 1.0}, "sparsity"),
        ({"sparsity": 1.5}, "sparsity"),
        ({"sparsity": -0.1}, "sparsity"),
        ({"sparsity": math.nan}, "sparsity"),
        ({"sparsity": "0.5"}, "sparsity"),
        ({"sparsity": True}, "sparsity"),
        ({"sparsity": None}, "sparsity"),
        ({"sparsity": [0.5, 1.0]}, "sparsity"),
        ({"schedule": 1.0}, "schedule"),
        ({"sparsity_schedule": [[0, 1.2]]}, "sparsity_schedule"),
        ({"sparsity_schedule": [[0]]}, "sparsity_schedule"),
        ({"algorithm": "set", "sparsity": 0.5, "update": 1, "drop_fraction": 1.5}, "drop_fraction"),
        ({"algorithm": "gmp", "sparsity": 0.5, "update": {"freq": 0}}, "update"),
        ({"algorithm": "gmp", "sparsity": 0.5, "schedule": {"freq": 2, "every": 3}}, "schedule"),
        ({"sparsity": 0.5, "seed": "one"}, "seed"),
        ({"sparsity": 0.5, "param_name_patterns": "fc("}, "param_name_patterns"),
        ({"sparsity": 0.5, "param_filter": 3}, "param_filter"),
        ({"sparsity": 0.5, "init_method": "lucky"}, "init_method"),
        ({"sparsity": 0.5, "distribution": "zipf"}, "distribution"),
        ({"algorithm": 5, "sparsity": 0.5}, "algorithm"),
        ({"algorithm": "gmp", "type": "set", "sparsity": 0.5}, "algorithm"),
        ({"algorithm": "group", "sparsity": 0.5}, "algorithm"),
        ({"algorithm": "static", "sparsity": 0.5, "schedule": 2}, "schedule"),
        ({"algorithm": "rigl", "sparsity": 0.5, "update": 1, "balance_in_groups": "2"}, "balance_in_groups"),
        ({"algorithm": "rigl", "sparsity": 0.5, "update": 1, "balance_out_groups": 0}, "balance_out_groups"),
    ],
    ids=lambda value: repr(value) if isinstance(value, str) else None,
)
def test_bad_values_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ValueError) as caught:
        configure(config)
    message = str(caught.value)
    # every message starts with the location "sparsity"; the key itself must be named too
    assert f"sparsity.{key}" in message or (key != "sparsity" and key in message), message


@pytest.mark.parametrize("config", ["0.5", None, True, [], {"groups": {}}, [0.5]], ids=repr)
def test_bad_config_shapes(config: object) -> None:
    with pytest.raises(ValueError, match="sparsity"):
        configure(config)


def test_group_errors_say_which_group() -> None:
    with pytest.raises(ValueError, match=r"sparsity\[1\]\.sparsity"):
        configure([{"param_filter": "fc1.weight", "sparsity": 0.5}, {"sparsity": 2.0}])


def test_modelzoo_nested_groups_and_the_default_filter_are_cstorchs():
    """ModelZoo's config classes nest a group's options under ``params`` (cstorch's
    ``flatten_sparsity_params`` reads them); the default filter leaves out ALiBi's
    ``pe_helper`` as cstorch's does. Both read alike through the two APIs."""
    import sparsity.cstorch as cstorch

    section = {"groups": [{"params": {"algorithm": "set", "sparsity": 0.5, "update": {"freq": 2}},
                           "param_filter": "fc*.weight"}]}
    model = make_model()
    model.pe_helper = nn.Linear(4, 4, bias=False)
    alg = configure(section)
    model.apply(alg)
    ours = sorted(name for name, _, _ in alg.sparse_parameters())
    theirs = cstorch.sparse.configure(section)
    assert ours == ["fc1.weight", "fc2.weight"] and type(alg).__name__ == "Group"
    assert type(theirs[0]).__name__ == "SET" and theirs[0].sparsity.default.value == 0.5
    defaults = configure(0.5)
    model = make_model()
    model.pe_helper = nn.Linear(4, 4, bias=False)
    model.apply(defaults)
    assert sorted(name for name, _, _ in defaults.sparse_parameters()) == ["fc1.weight", "fc2.weight"]
