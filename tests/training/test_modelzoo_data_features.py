"""The last ModelZoo features the corpus needed (issue 44 item 5): ``train_input.mixture`` (a
weighted mixture of HDF5 data sets, ModelZoo's semantics), the ``add_sink_tokens`` data
transform, each training a proxy of its published file; and the plan naming every
architectural feature a file builds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from csx_config import JobSpec
from models.config import ModelConfig
from training.data import load_data
from training.hdf5 import HDF5Mixture, HDF5Samples, SinkTokens, write_hdf5
from training.loop import train
from training.plan import plan_job
from training.report import plan_report, plan_table

torch.set_num_threads(1)
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "modelzoo_corpus"
JAIS_MIXTURE = CORPUS / "jais/params_v2/r2.3.0_params_jais_30b_phase1.yaml"
GEMMA2_SINKS = CORPUS / "gemma2/trainer/r2.5.0_params_gemma2_9b_msl8k_swa_4k_sink_512.yaml"
SEQ = 8


def tagged_set(folder: Path, tag: int, samples: int) -> str:
    """An HDF5 data set of `samples` samples whose row r starts with token tag*1000 + r."""
    stream = tag * 1000 + torch.arange(samples * SEQ + 1) // SEQ
    write_hdf5(stream, folder, seq_len=SEQ, samples_per_file=5, pad_id=0, params={})
    return str(folder)


def set_and_row(inputs: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(token) // 1000, int(token) % 1000) for token in inputs[:, 0]]


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture")
    return [tagged_set(root / f"set{tag}", tag, samples) for tag, samples in ((1, 12), (2, 7), (3, 3), (4, 5))]


# ----------------------------------------------------------------------------- mixture
@settings(max_examples=30)
@given(weights=st.lists(st.sampled_from([0.0, 0.02, 0.1, 0.25, 0.5, 1.0, 3.0]), min_size=4, max_size=4)
       .filter(lambda w: any(x > 0 for x in w) and any(x / sum(w) > 0.05 for x in w)),
       interleave=st.booleans(), seed=st.integers(0, 2**16))
def test_one_pass_of_a_mixture_is_modelzoos(sets, weights, interleave, seed):
    """Per pass: set i takes int(pass · w_i) positions (w normalised over the sets above 0), the
    pass the largest len/w of the sets above 5%, each set's rows in order from 0 (wrapping);
    a weight-0 set never appears; interleaved, the same seed deals the same order."""
    samples = [HDF5Samples([folder], "t") for folder in sets]
    mixture = HDF5Mixture(samples, weights, interleave=interleave, seed=seed, what="t")
    kept = [(len(s), w / sum(weights)) for s, w in zip(samples, weights) if w > 0]
    one_pass = max(length / share for length, share in kept if share > 0.05)
    assert len(mixture) == sum(int(one_pass * share) for _, share in kept)
    seen = set_and_row(mixture.rows(range(len(mixture)))[0])
    for tag, (size, weight) in enumerate(zip(map(len, samples), weights), 1):
        rows = [row for which, row in seen if which == tag]
        assert len(rows) == (int(one_pass * (weight / sum(weights))) if weight > 0 else 0)
        assert rows == [i % size for i in range(len(rows))]  # in order, wrapping round the set
    if interleave:
        again = HDF5Mixture(samples, weights, interleave=True, seed=seed, what="t")
        assert set_and_row(again.rows(range(len(again)))[0]) == seen
        tags = [which for which, _ in seen]
        assert len(set(tags)) == 1 or tags != sorted(tags)  # the sets are dealt out, not in blocks


def test_the_interleaving_is_modelzoos_numpy_permutation(sets):
    """ModelZoo deals the positions by numpy's default_rng(seed).shuffle, then puts each set's
    positions back in order: the same permutation gives the same sequence of sets."""
    samples = [HDF5Samples([folder], "t") for folder in sets[:2]]
    mixture = HDF5Mixture(samples, [1.0, 1.0], interleave=True, seed=7, what="t")
    size, half = len(mixture), int(mixture.boundaries[1])
    order = np.arange(size)
    np.random.default_rng(7).shuffle(order)
    expected = [1 if position < half else 2 for position in order]
    assert [which for which, _ in set_and_row(mixture.rows(range(size))[0])] == expected


def test_a_published_mixture_file_trains_a_proxy_on_its_weights(sets, tmp_path):
    """Jais 30B phase 1 (19 weighted data sets), its weights unchanged, each set's data_dir on
    one of four tiny sets, shrunk: it validates, trains, and its batches follow the mixture."""
    params = yaml.safe_load(JAIS_MIXTURE.read_text())
    for index, entry in enumerate(params["train_input"]["mixture"]):
        entry["data_dir"] = sets[index % len(sets)]
    overrides = ["model.num_hidden_layers=1", "model.hidden_size=32", "model.num_heads=4", "model.filter_size=64",
                 "model.vocab_size=5000", f"model.max_position_embeddings={SEQ}", "train_input.batch_size=4",
                 f"eval_input.data_dir={sets[0]}", "eval_input.batch_size=4", "runconfig.max_steps=3",
                 "runconfig.log_steps=3", "runconfig.eval_steps=1", "runconfig.mlflow_experiment=",
                 "runconfig.sparse_kernel=dense", "runconfig.checkpoint_steps=0"]
    spec = JobSpec.from_yaml(yaml.safe_dump(params), overrides)
    summary = train(plan_job(spec), model_dir=str(tmp_path))
    assert summary["steps"] == 3 and np.isfinite(summary["train_loss"])
    mixture = load_data(plan_job(spec).data, None).sampler.samples
    shares = [entry["weight"] / sum(e["weight"] for e in params["train_input"]["mixture"])
              for entry in params["train_input"]["mixture"]]
    one_pass = max(len(samples) / share for samples, share in zip(mixture.sets, shares) if share > 0.05)
    assert np.diff(mixture.boundaries).tolist() == [int(one_pass * share) for share in shares]
    read = [which for which, _ in set_and_row(mixture.rows(range(len(mixture)))[0])]
    for tag in range(1, len(sets) + 1):  # entry i reads set i mod 4, as many rows as its share
        assert read.count(tag) == sum(int(one_pass * share) for i, share in enumerate(shares) if i % 4 == tag - 1)


def test_mixture_and_data_dir_together_are_refused():
    with pytest.raises(ValueError, match="give data_dir or mixture, not both"):
        JobSpec.model_validate({"train_input": {"data_dir": "x", "mixture": [{"data_dir": "y", "weight": 1.0}]}})


# ----------------------------------------------------------------------------- sink tokens
@pytest.mark.parametrize(("start", "truncate"), [(0, False), (3, False), (2, True)])
def test_sink_tokens_go_in_at_their_position_outside_the_loss(sets, start, truncate):
    samples = HDF5Samples([sets[0]], "t")
    sunk = SinkTokens(samples, token_id=99, count=4, start=start, truncate=truncate, what="t")
    inputs, labels = samples.rows([0, 1])
    got_inputs, got_labels = sunk.rows([0, 1])
    assert sunk.seq_len == got_inputs.shape[1] == (SEQ if truncate else SEQ + 4)
    assert torch.equal(got_inputs[:, start:start + 4], torch.full((2, 4), 99))
    assert torch.equal(got_labels[:, start:start + 4], torch.full((2, 4), -100))
    assert torch.equal(got_inputs[:, :start], inputs[:, :start])
    tail = got_inputs.shape[1] - start - 4
    assert torch.equal(got_inputs[:, start + 4:], inputs[:, start:start + tail])
    assert torch.equal(got_labels[:, start + 4:], labels[:, start:start + tail])


def test_a_published_sink_token_file_trains_a_proxy(sets, tmp_path, capsys):
    """Gemma-2 9B with 512 sink tokens, shrunk (4 sinks, window 4): each training sample
    starts with its sink tokens, outside the loss; the plan's sequence is the data's plus
    the sinks and names the architecture it builds."""
    overrides = ["model.num_hidden_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.filter_size=64",
                 "model.vocab_size=5000", "model.attention_inner_dim=32", "model.rotary_dim=8",
                 "model.extra_attention_params.num_kv_groups=2", f"model.max_position_embeddings={SEQ + 4}",
                 "model.attention_sliding_window_length=4", "model.attention_sink_tokens=4",
                 f"train_input.data_dir={sets[0]}", f"eval_input.data_dir={sets[1]}", "train_input.batch_size=4",
                 "eval_input.batch_size=4",
                 "train_input.data_transforms=[{name: add_sink_tokens, sink_token_id: 4999, num_sink_tokens: 4}]",
                 "runconfig.max_steps=3", "runconfig.log_steps=3",
                 "runconfig.eval_steps=1", "runconfig.mlflow_experiment=", "runconfig.sparse_kernel=dense"]
    spec = JobSpec.from_yaml(GEMMA2_SINKS.read_text(), overrides)
    inputs, labels = load_data(plan_job(spec).data, None).sampler.next_batch()
    assert inputs.shape == (4, SEQ + 4) and (inputs[:, :4] == 4999).all() and (labels[:, :4] == -100).all()
    plan = plan_report(plan_job(spec, 1))
    assert plan["seq_len"] == SEQ + 4
    summary = train(plan_job(spec), model_dir=str(tmp_path), mode="train_and_eval")
    assert summary["steps"] == 3 and np.isfinite(summary["final_eval_loss"])


def test_sink_tokens_beyond_the_context_are_refused_by_the_plan():
    spec = JobSpec.model_validate({"train_input": {"max_sequence_length": 8, "data_transforms": [
        {"name": "add_sink_tokens", "num_sink_tokens": 4}]}, "model": {"preset": "tiny", "max_position_embeddings": 10}})
    with pytest.raises(ValueError, match="8 tokens and 4 sink tokens .* exceed model.max_position_embeddings"):
        plan_report(plan_job(spec, 1))


# ----------------------------------------------------------------------------- the plan
FEATURES = [  # a key that changes the architecture, its value, what the plan says
    ({"model_class": "GPTJModel", "position_embedding_type": "rotary"}, "parallel attention and FFN"),
    ({"attention_sliding_window_length": 16}, "sliding window 16"),
    ({"attention_sliding_window_length": 16, "sliding_window_every_other_decoder_layer": True},
     "sliding window 16 on every other layer"),
    ({"attention_sliding_window_length": 16, "attention_sink_tokens": 2}, "2 attention sink tokens"),
    ({"attention_logit_softcapping": 50.0}, "attention logit soft-capping 50"),
    ({"final_logit_softcapping": 30.0}, "final logit soft-capping 30"),
    ({"norm_first_sandwich": True}, "sandwich norms"),
    ({"embedding_layer_norm": True}, "embedding layer norm"),
    ({"attention_type": "dot_product"}, "unscaled dot-product attention"),
    ({"scale_qk_dot_by_layer_idx": True}, "QK scaled by 1/(layer + 1)"),
    ({"attention_inner_dim": 128}, "attention width 128"),
    ({"rotary_dim": 8}, "rotary on 8 of 16 head dims"),
    ({"position_embedding_type": "alibi", "alibi_trainable_slopes": True}, "trainable ALiBi slopes"),
    ({"share_embedding_weights": False}, "untied lm_head"),
    ({"mup_base_hidden_size": 32.0, "mup_base_filter_size": 80.0}, "muP"),
    ({"sparse_wide_sparsity": 0.5}, "Sparse-Wide s=0.5"),
    ({"moe": {"num_experts": 4, "top_k": 2, "num_shared_experts": 1}}, "4 experts, top 2 + 1 shared"),
]


@pytest.mark.parametrize(("keys", "said"), FEATURES, ids=[said for _, said in FEATURES])
def test_every_architectural_feature_is_named(keys, said):
    assert said in ModelConfig(**keys).features()
    assert said not in ModelConfig().features()


def test_the_gemma2_plan_names_what_it_builds(capsys):
    spec = JobSpec.from_yaml(GEMMA2_SINKS.read_text())
    line = plan_table(plan_report(plan_job(spec, 1))).splitlines()[1]
    for said in ("sliding window 4096 on every other layer", "512 attention sink tokens",
                 "attention logit soft-capping 50", "final logit soft-capping 30", "sandwich norms"):
        assert said in line, line
    assert replace(ModelConfig(), norm_first_sandwich=True).features() == ["sandwich norms"]
