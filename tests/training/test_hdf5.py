"""ModelZoo HDF5 data: `csx preprocess` writes ModelZoo's layout, the sampler reads one or
several data_dirs with deterministic sharding over replicas, bad data dirs are named."""

import json

import h5py
import numpy as np
import pytest
import torch

from csx import cli
from training.text import strip_gutenberg
from training.hdf5 import HDF5BatchSampler, HDF5EvalBatches, HDF5Samples
from training.data import check_data, load_data
from csx_config import JobSpec
from training_helpers import preprocess_texts
from training.plan import plan_job

TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(40))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two HDF5 folders made by `csx preprocess` from a text file (byte tokenizer, msl 16)."""
    return preprocess_texts(tmp_path_factory.mktemp("hdf5"), {"a": TEXT[:1000], "b": TEXT[1000:]},
                            16, "--samples_per_file", "20")


def test_preprocess_writes_modelzoos_layout(corpus):
    files = sorted((corpus / "a").glob("*.h5"))
    assert [f.name for f in files] == ["data-00000.h5", "data-00001.h5", "data-00002.h5", "data-00003.h5"]
    data = np.concatenate([h5py.File(f, "r")["data"][:] for f in files])
    assert data.shape[1:] == (3, 16) and data.dtype == np.int32
    inputs, mask, labels = data[:, 0], data[:, 1], data[:, 2]
    stream = np.frombuffer(strip_gutenberg(TEXT[:1000]).encode(), dtype=np.uint8)
    assert np.array_equal(inputs.reshape(-1)[:999], stream[:999])  # consecutive windows
    assert np.array_equal(labels[:, :-1], inputs[:, 1:])  # labels are the inputs shifted by one
    assert mask.sum() == len(stream) - 1 and mask[-1, -1] == 0  # the last sample is padded
    params = json.loads((corpus / "a" / "data_params.json").read_text())
    assert params["max_seq_length"] == 16 and params["vocab_size"] == 256 and params["n_examples"] == len(data)


def test_preprocess_with_a_local_bpe_vocabulary(tmp_path):
    from training.text import BPETokenizer

    vocab = tmp_path / "tokenizer.json"
    vocab.write_text(BPETokenizer.train([TEXT], 300)._tokenizer.to_str())
    (tmp_path / "in.txt").write_text(TEXT)
    summary = cli.main(["preprocess", "--input", str(tmp_path / "in.txt"), "--output_dir", str(tmp_path / "out"),
                        "--max_sequence_length", "8", "--vocab_file", str(vocab)])
    assert summary == 0
    samples = HDF5Samples([str(tmp_path / "out")], "train_input")
    inputs, _ = samples.rows(range(len(samples)))
    tokenizer = BPETokenizer.from_files(str(vocab), None)
    assert int(inputs.max()) < tokenizer.vocab_size <= 300
    assert tokenizer.decode(inputs.reshape(-1).tolist()).startswith(TEXT[:200])


def test_text_data_with_a_bpe_from_a_local_vocabulary_file(tmp_path):
    from training.text import BPETokenizer

    vocab = tmp_path / "tokenizer.json"
    vocab.write_text(BPETokenizer.train([TEXT], 300)._tokenizer.to_str())
    (tmp_path / "corpus.txt").write_text(TEXT)
    spec = JobSpec.from_yaml(f"""
train_input: {{data_dir: "{tmp_path / 'corpus.txt'}", batch_size: 2, max_sequence_length: 8}}
model: {{preset: tiny, tokenizer: {{type: bpe, vocab_file: "{vocab}"}}}}
runconfig: {{eval_steps: 1}}
""")
    data = load_data(plan_job(spec).data, None)
    assert data.vocab_size == BPETokenizer.from_files(str(vocab), None).vocab_size
    assert data.tokenizer_json["type"] == "bpe" and int(data.sampler.next_batch()[0].max()) < data.vocab_size
    with pytest.raises(ValueError, match="does not exist"):
        missing = spec.model.tokenizer.model_copy(update={"vocab_file": "/no/such.json"})
        load_data(plan_job(spec.model_copy(update={"model": spec.model.model_copy(
            update={"tokenizer": missing})})).data, None)


def test_sampler_shards_deterministically_over_several_dirs(corpus):
    dirs = [str(corpus / "a"), str(corpus / "b")]
    samples = HDF5Samples(dirs, "train_input")
    one = HDF5BatchSampler(samples, batch_size=8, seed=3, shuffle=True, vocab_size=256)
    ranks = [HDF5BatchSampler(samples, batch_size=8, seed=3, shuffle=True, vocab_size=256, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(3):
        whole = one.next_batch()
        parts = [sampler.next_batch() for sampler in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    indices = [i for b in range(20) for i in one.global_indices(b)]
    assert sorted(indices[:len(samples)]) == list(range(len(samples)))  # one epoch visits each sample once
    assert max(indices) >= samples.offsets[2]  # the second data_dir is read too
    resumed = HDF5BatchSampler(samples, batch_size=8, seed=3, shuffle=True, vocab_size=256)
    resumed.load_state_dict(one.state_dict())
    assert torch.equal(resumed.next_batch()[0], one.next_batch()[0])
    other = HDF5BatchSampler(samples, batch_size=8, seed=4, shuffle=True, vocab_size=256)
    assert other.global_indices(0) != one.global_indices(0)


def test_padding_labels_are_ignored_and_vocab_is_checked(corpus):
    samples = HDF5Samples([str(corpus / "a")], "eval_input")
    last_inputs, last_labels = samples.rows([len(samples) - 1])
    assert (last_labels == -100).any() and (last_labels[last_labels != -100] >= 0).all()
    batches = HDF5EvalBatches(samples, batch_size=4, steps=2, vocab_size=256)
    assert len(batches) == 2 and [b[0].shape for b in batches] == [(4, 16), (4, 16)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, batches))  # the same every time
    with pytest.raises(ValueError, match="model.vocab_size is 100"):
        list(HDF5EvalBatches(samples, batch_size=4, steps=1, vocab_size=100))


def test_load_data_reads_hdf5_from_the_spec(corpus):
    spec = JobSpec.from_yaml(f"""
train_input: {{data_processor: GptHDF5MapDataProcessor, data_dir: ["{corpus / 'a'}"], batch_size: 4}}
eval_input: {{data_dir: "{corpus / 'b'}", batch_size: 4}}
model: {{vocab_size: 256}}
runconfig: {{eval_steps: 2}}
""")
    data = load_data(plan_job(spec, 2).data, None, rank=1, world_size=2)
    assert data.vocab_size == 256 and data.sampler.seq_len == 16 and data.tokenizer_json["type"] == "pretokenized"
    assert data.sampler.next_batch()[0].shape == (2, 16) and len(data.eval_data) == 2
    assert [inputs.shape for inputs, _ in data.eval_data] == [(2, 16), (2, 16)]


def test_bad_data_dirs_are_named(corpus, tmp_path):
    def spec(train_dir, extra=""):
        return JobSpec.from_yaml(f'train_input: {{data_processor: GptHDF5DataProcessor, data_dir: "{train_dir}"{extra}}}')

    with pytest.raises(ValueError, match="data_dir .*does not exist"):
        check_data(plan_job(spec(tmp_path / "missing")).data)
    with pytest.raises(ValueError, match="holds no .h5 files"):
        check_data(plan_job(spec(tmp_path)).data)
    bad = tmp_path / "bad"
    bad.mkdir()
    with h5py.File(bad / "data-0.h5", "w") as handle:
        handle.create_dataset("data", data=np.zeros((4, 16), dtype=np.int32))
    with pytest.raises(ValueError, match=r"shape \[n, 3, msl\]"):
        check_data(plan_job(spec(bad)).data)
    (bad / "data-0.h5").write_text("not hdf5")
    with pytest.raises(ValueError, match="not a readable HDF5 file"):
        check_data(plan_job(spec(bad)).data)
    with pytest.raises(ValueError, match="max_sequence_length is 32.*sequences of 16"):
        check_data(plan_job(spec(corpus / "a", ", max_sequence_length: 32")).data)
    with pytest.raises(ValueError, match="text data takes one data_dir"):
        two_dirs = JobSpec.from_yaml(f'train_input: {{data_dir: ["{tmp_path}", "{tmp_path}"]}}')
        check_data(plan_job(two_dirs).data)
