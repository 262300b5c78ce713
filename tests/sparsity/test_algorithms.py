import pytest
import torch
from torch import nn

import sparsity
from sparsity_helpers import TinyNet, train_steps


def masks_of(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_mask")}


def test_default_filter_skips_embeddings_norms_biases_and_head():
    model = nn.ModuleDict({"embedding": nn.Embedding(5, 4), "proj": nn.Linear(4, 4), "lm_head": nn.Linear(4, 5),
                           "final_norm": nn.LayerNorm(4)})
    alg = sparsity.Static(sparsity=0.5)
    model.apply(alg)
    assert [n for n, _, _ in alg.sparse_parameters()] == ["proj.weight"]
    assert "proj.weight_mask" in model.state_dict()


def test_model_apply_equals_alg_apply_with_root_relative_names():
    a, b = TinyNet(), TinyNet()
    b.load_state_dict(a.state_dict())
    a.apply(sparsity.Static(sparsity=0.7, param_filter="fc*.weight"))
    sparsity.Static(sparsity=0.7, param_filter="fc*.weight").apply(b)
    assert sorted(masks_of(a)) == ["fc1.weight_mask", "fc2.weight_mask"]
    for key, mask in masks_of(a).items():
        assert torch.equal(mask, masks_of(b)[key])


def test_static_masks_exist_and_apply_without_initialize():
    model = TinyNet()
    alg = sparsity.Static(sparsity=0.75)
    model.apply(alg)
    assert (model.fc1.weight == 0).sum() == 180  # 240 weights, exact count
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(opt)
    train_steps(model, opt, 3)
    assert (model.fc1.weight[~model.fc1.weight_mask] == 0).all()


def test_gmp_hand_worked_never_regrows():
    model = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.1, -0.8, 0.3, 0.0], [0.5, -0.2, 0.05, 0.9]]))
    alg = sparsity.GMP(sparsity={"type": "linear", "init": 0.0, "slope": 0.25}, update=1, param_filter="weight")
    model.apply(alg)
    alg.step = 1
    alg.update()  # target 0.25 -> keep 6 of 8: drops 0.0 and 0.05
    assert model.weight_mask.tolist() == [[True, True, True, False], [True, True, False, True]]
    alg.step = 2
    alg.update()  # target 0.5 -> keep 4: drops 0.1 and 0.2
    assert model.weight_mask.tolist() == [[False, True, True, False], [True, False, False, True]]


def test_rigl_grows_by_dense_gradient_and_zero_initialises():
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.2, 0.7, 0.3]]))
    alg = sparsity.RigL(sparsity=0.5, update=1, drop_fraction=0.5, param_filter="weight", init_method="topk")
    model.apply(alg)  # keeps 1.0 and 0.7
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    alg.apply(opt)
    model.weight.grad = torch.tensor([[0.0, 5.0, 0.0, 1.0]])
    opt.step()
    # drop 1 of 2 (0.7), grow the inactive entry with the largest |grad| (index 1) at weight 0
    assert model.weight_mask.tolist() == [[True, True, False, False]]
    assert model.weight.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("name", ["set", "rigl", "granet"])
def test_dynamic_algorithms_keep_exact_counts_and_change_masks(name):
    torch.manual_seed(0)
    model = TinyNet()
    kwargs = {"update": {"freq": 2, "stop": 100}}
    alg = sparsity.get_algorithm_class(name)(sparsity=0.8, **kwargs)
    model.apply(alg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alg.apply(opt)
    before = masks_of(model)
    train_steps(model, opt, 6)
    after = masks_of(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for key, mask in after.items():
        assert int(mask.sum()) == sparsity.keep_count(mask.numel(), alg.update_targets(alg.step)[key[:-5]])
    assert 0 < alg.metrics()["mask/churn"] <= 1
    assert alg.metrics()["mask/itop_rate"] > 0.2


def test_granet_prunes_to_cubic_target_then_regrows_dense_to_sparse():
    model = TinyNet()
    alg = sparsity.GraNet(sparsity=0.9, init_sparsity=0.0, update={"freq": 1, "stop": 6}, pruning="layer")
    model.apply(alg)
    assert all(bool(m.all()) for m in masks_of(model).values())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    alg.apply(opt)
    for _ in range(6):
        train_steps(model, opt, 1)
        target = alg.target_sparsity(alg.step) if alg.step < 6 else 0.9
        for key, mask in masks_of(model).items():
            assert int(mask.sum()) == sparsity.keep_count(mask.numel(), target), (alg.step, key)


def test_group_first_match_wins_and_unmatched_stay_dense():
    model = TinyNet()
    group = sparsity.Group({"fc1.*": sparsity.Static(sparsity=0.3), "fc*.weight": sparsity.SET(sparsity=0.9, update=1)})
    model.apply(group)
    assert sorted(masks_of(model)) == ["fc1.bias_mask", "fc1.weight_mask", "fc2.weight_mask"]
    assert abs(group.metrics()["sparsity/fc2.weight/actual"] - 0.9) < 0.01
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    group.apply(opt)
    fc1 = model.fc1.weight_mask.clone()
    train_steps(model, opt, 2)
    assert torch.equal(fc1, model.fc1.weight_mask) and group.step == 2


def test_requires_dense_on_parameter_and_module_opts_out():
    model = TinyNet()
    model.fc1.weight.requires_dense = True
    model.fc2.requires_dense = True
    alg = sparsity.Static(sparsity=0.5)
    model.apply(alg)
    assert alg.sparse_parameters() == []


def test_optimizer_state_tensor_with_requires_dense_is_not_masked():
    model = TinyNet()
    alg = sparsity.Static(sparsity=0.5)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    alg.apply(opt)
    train_steps(model, opt, 1)
    buf = opt.state[model.fc1.weight]["momentum_buffer"]
    buf.fill_(1.0)
    buf.requires_dense = True
    train_steps(model, opt, 1)
    assert (buf[~model.fc1.weight_mask] != 0).all()


def test_autoupdate_off_then_manual_update():
    model = TinyNet()
    alg = sparsity.SET(sparsity=0.5, update=1)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(opt)
    alg.autoupdate = False
    before = masks_of(model)
    train_steps(model, opt, 2)
    assert all(torch.equal(before[k], v) for k, v in masks_of(model).items())
    alg.update()
    assert any(not torch.equal(before[k], v) for k, v in masks_of(model).items())


def test_sparsity_optim_subclasses_offer_apply_and_are_torch_optimizers():
    model = TinyNet()
    alg = sparsity.RigL(sparsity=0.5, update=1)
    model.apply(alg)
    opt = sparsity.optim.AdamW(model.parameters(), lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    opt.apply(alg)
    train_steps(model, opt, 2)
    assert alg.step == 2


def test_hooks_report_targets_and_computed_levels_and_remove():
    model = TinyNet()
    alg = sparsity.SET(sparsity=0.6, update=1)
    seen = []
    handle = alg.register_computed_sparsity_hook(lambda a, name, actual: seen.append((name, round(actual, 3))))
    targets = []
    alg.register_target_sparsity_hook(lambda a, name, t: targets.append((name, t)))
    model.apply(alg)
    assert ("fc1.weight", 0.6) in seen and ("fc1.weight", 0.6) in targets
    handle.remove()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(opt)
    n = len(seen)
    train_steps(model, opt, 1)
    assert len(seen) == n and len(targets) > 2


def test_two_optimizers_each_mask_their_own_parameters():
    model = TinyNet()
    alg = sparsity.RigL(sparsity=0.7, update=1)
    model.apply(alg)
    opt1 = torch.optim.Adam(model.fc1.parameters(), lr=1e-2)
    opt2 = torch.optim.SGD(model.fc2.parameters(), lr=1e-2, momentum=0.9)
    alg.apply(opt1)
    alg.apply(opt2)
    x, y = torch.randn(8, 12), torch.randn(8, 6)
    for _ in range(3):
        opt1.zero_grad(), opt2.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt1.step(), opt2.step()
    assert alg.step == 3
    assert (opt2.state[model.fc2.weight]["momentum_buffer"][~model.fc2.weight_mask] == 0).all()
    assert (opt1.state[model.fc1.weight]["exp_avg"][~model.fc1.weight_mask] == 0).all()


def test_grad_scaler_skipped_step_skips_the_mask_update():
    model = TinyNet()
    alg = sparsity.SET(sparsity=0.5, update=1)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(opt)
    scaler = torch.amp.GradScaler("cpu")
    before = masks_of(model)
    loss = model(torch.randn(4, 12)).sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert alg.step == 0 and all(torch.equal(before[k], v) for k, v in masks_of(model).items())


def test_works_under_bf16_autocast():
    model = TinyNet()
    alg = sparsity.RigL(sparsity=0.5, update=1)
    model.apply(alg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alg.apply(opt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 12)).float().pow(2).mean()
    loss.backward()
    opt.step()
    assert alg.step == 1 and (model.fc1.weight[~model.fc1.weight_mask] == 0).all()


def test_mask_gradients_before_clipping_zeroes_masked_grads():
    model = TinyNet()
    alg = sparsity.RigL(sparsity=0.5, update=1)
    model.apply(alg)
    model(torch.randn(4, 12)).sum().backward()
    alg.mask_gradients()
    assert (model.fc1.weight.grad[~model.fc1.weight_mask] == 0).all()
    assert alg.needs_dense_grad()


def test_unknown_algorithm_lists_known_names_and_how_to_register():
    with pytest.raises(ValueError, match=r"unknown sparsity algorithm 'magic'.*rigl.*Register"):
        sparsity.get_algorithm_class("magic")


def test_custom_dynamic_algorithm_registers_and_runs():
    class KeepFirst(sparsity.DynamicSparsityAlgorithm):
        def update_mask(self, p, mask, level):
            return sparsity.topk_mask(-torch.arange(p.numel()).float().reshape(1, -1),
                                      sparsity.keep_count(p.numel(), level)).reshape(p.shape)

    assert sparsity.get_algorithm_class("keepfirst") is KeepFirst
    model = TinyNet()
    alg = KeepFirst(sparsity=0.5, update=1)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(opt)
    train_steps(model, opt, 1)
    assert model.fc1.weight_mask.reshape(-1)[:120].all() and not model.fc1.weight_mask.reshape(-1)[120:].any()


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, float("nan")])
def test_bad_sparsity_names_the_field(bad):
    with pytest.raises(ValueError, match="sparsity"):
        sparsity.Static(sparsity=bad)


def test_balance_out_groups_gives_equal_counts_per_row_group():
    model = nn.Linear(8, 8, bias=False)
    alg = sparsity.RigL(sparsity=0.75, update=1, balance_out_groups=4)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(opt)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    counts = model.weight_mask.reshape(4, -1).sum(dim=1)
    assert counts.tolist() == [4, 4, 4, 4]


def test_group_is_a_container_not_an_algorithm_name():
    assert "group" not in sparsity.algorithm_names()
    assert {"static", "gmp", "set", "rigl", "granet"} <= set(sparsity.algorithm_names())


def test_dynamic_algorithm_without_update_cadence_is_refused():
    with pytest.raises(ValueError, match="'update' is required"):
        sparsity.SET(sparsity=0.5)


@pytest.mark.parametrize("bad", ["2", 0, 1.5])
def test_balance_groups_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="balance_out_groups"):
        sparsity.RigL(sparsity=0.5, update=1, balance_out_groups=bad)


@pytest.mark.parametrize("method", ["random", "topk", "checkerboard"])
def test_init_methods_give_exact_counts(method):
    model = nn.Linear(20, 10, bias=False)
    model.apply(sparsity.Static(sparsity=0.7, init_method=method))
    assert int(model.weight_mask.sum()) == 60


def test_init_topk_keeps_largest_and_from_zeros_keeps_nonzeros_and_checkerboard_spreads():
    model = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.1, -3.0, 0.0, 2.0], [0.0, 0.5, -0.2, 0.0]]))
    model.apply(sparsity.Static(sparsity=0.75, init_method="topk"))
    assert model.weight_mask.tolist() == [[False, True, False, True], [False, False, False, False]]
    other = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        other.weight.copy_(torch.tensor([[0.1, 0.0, 0.0, 2.0], [0.0, 0.5, 0.0, 0.0]]))
    other.apply(sparsity.Static(sparsity=0.5, init_method="from_zeros"))
    assert other.weight_mask.tolist() == [[True, False, False, True], [False, True, False, False]]
    board = nn.Linear(4, 2, bias=False)
    board.apply(sparsity.Static(sparsity=0.5, init_method="checkerboard"))
    assert board.weight_mask.reshape(-1).tolist() == [True, False] * 4


def test_erk_distribution_inside_an_algorithm():
    model = nn.Sequential(nn.Linear(784, 300), nn.Linear(300, 100), nn.Linear(100, 10))
    alg = sparsity.Static(sparsity=0.9, distribution="erk")
    model.apply(alg)
    got = alg.metrics()
    assert got["sparsity/0.weight/actual"] == pytest.approx(0.9204, abs=1e-3)
    assert got["sparsity/1.weight/actual"] == pytest.approx(0.7698, abs=1e-3)
    assert got["sparsity/2.weight/actual"] == 0.0
    assert got["sparsity/global"] == pytest.approx(0.9, abs=1e-3)


def _columns_grown(grow_score_scaling):
    """Where one RigL update grows, when two input channels are 100x louder than the rest."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16, bias=False)
    alg = sparsity.RigL(sparsity=0.75, update=1, drop_fraction=0.5, seed=0,
                        grow_score_scaling=grow_score_scaling)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    alg.apply(opt)
    before = model.weight_mask.clone()
    x = torch.randn(64, 16)
    x[:, :2] *= 100
    (model(x) * torch.randn(64, 16)).sum().backward()
    opt.step()
    return (model.weight_mask & ~before).sum(dim=0)


def test_sinkhorn_grow_score_does_not_pile_onto_loud_input_columns():
    plain, scaled = _columns_grown(None), _columns_grown("sinkhorn")
    assert plain[:2].sum() >= 0.8 * plain.sum()  # |δ xᵀ| follows the loud channels
    assert scaled[:2].sum() <= 0.4 * scaled.sum() and int((scaled > 0).sum()) >= 12


def test_grow_score_scaling_is_checked_by_name():
    with pytest.raises(ValueError, match="grow_score_scaling"):
        sparsity.configure({"algorithm": "rigl", "sparsity": 0.5, "update": {"freq": 1},
                            "grow_score_scaling": "softmax"})
