"""Corpora, split by play; Gutenberg boilerplate; the seeded, resumable, rank-sliced sampler."""

import sys
import pytest
import torch

from training.text import (BatchSampler, ByteTokenizer, encode_documents, eval_batches, load_splits,
                          make_tokenizer, strip_gutenberg, tokenizer_from_json)


def test_shakespeare_split_by_play_is_deterministic():
    first, second = load_splits("builtin:shakespeare"), load_splits("builtin:shakespeare")
    assert first.validation_names == second.validation_names
    assert 3 <= len(first.validation_names) <= 6
    assert len(first.train) + len(first.validation) == 42
    held_out = set(first.validation)
    assert not held_out & set(first.train)  # no play on both sides


def test_shakespeare_text_has_no_gutenberg_boilerplate():
    splits = load_splits("builtin:shakespeare")
    for text in splits.train + splits.validation:
        assert "gutenberg" not in text.lower()


def test_strip_gutenberg_header_and_footer():
    raw = ("The Project Gutenberg EBook of Hamlet\nlicence blah\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nACT I.\nWho's there?\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence\n")
    assert strip_gutenberg(raw) == "ACT I.\nWho's there?\n"
    old = "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nText.\nEnd of the Project Gutenberg Etext\n"
    assert strip_gutenberg(old) == "Text.\n"
    assert strip_gutenberg("plain text") == "plain text\n"


def test_folder_split_by_file_and_single_file_split(tmp_path):
    for i in range(10):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\n" * 5)
    splits = load_splits(str(tmp_path))
    assert len(splits.validation) == 1 and len(splits.train) == 9
    single = tmp_path / "doc0.txt"
    one = load_splits(str(single))
    assert "".join(one.train + one.validation) == single.read_text()
    with pytest.raises(ValueError, match="data_dir"):
        load_splits(str(tmp_path / "missing"))


def test_saved_hugging_face_dataset_uses_its_train_and_validation_splits(tmp_path):
    import datasets

    saved = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["to be or not", "to be"], "id": [1, 2]}),
        "validation": datasets.Dataset.from_dict({"text": ["that is the question"], "id": [3]}),
    })
    saved.save_to_disk(str(tmp_path / "hf"))
    splits = load_splits(str(tmp_path / "hf"))
    assert splits.train == ["to be or not", "to be"]
    assert splits.validation == ["that is the question"]


def test_hf_dataset_without_datasets_package_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train"]}')
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(ValueError, match="datasets"):
        load_splits(str(tmp_path))


def test_byte_tokenizer_round_trip_and_json():
    tok = ByteTokenizer()
    assert tok.decode(list(tok.encode("Thou art — ay"))) == "Thou art — ay"
    assert isinstance(tokenizer_from_json(tok.to_json()), ByteTokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        tokenizer_from_json({"type": "wordpiece"})


def test_bpe_needs_tokenizers_or_round_trips():
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="tokenizers"):
            make_tokenizer("bpe", 300, ["to be or not to be"])
        return
    tok = make_tokenizer("bpe", 300, ["to be or not to be, that is the question"] * 20)
    again = tokenizer_from_json(tok.to_json())
    assert again.decode(again.encode("to be or not")) == "to be or not"


def _stream(n=1000):
    return torch.arange(n) % 251


def test_sampler_is_seeded_and_resumable():
    a = BatchSampler(_stream(), batch_size=4, seq_len=8, seed=3, shuffle=True)
    batches = [a.next_batch() for _ in range(5)]
    b = BatchSampler(_stream(), batch_size=4, seq_len=8, seed=3, shuffle=True)
    b.load_state_dict({"position": 3})
    assert torch.equal(b.next_batch()[0], batches[3][0])
    x, y = batches[0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    other = BatchSampler(_stream(), batch_size=4, seq_len=8, seed=4, shuffle=True)
    assert not torch.equal(other.next_batch()[0], batches[0][0])


def test_ranks_slice_the_same_global_batch():
    whole = BatchSampler(_stream(), batch_size=4, seq_len=8, seed=0, shuffle=True).next_batch()[0]
    parts = [BatchSampler(_stream(), batch_size=4, seq_len=8, seed=0, shuffle=True, rank=r,
                          world_size=2).next_batch()[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)  # a batch that does not split: the plan's rule


def test_sequential_sampler_and_eval_batches_are_fixed():
    seq = BatchSampler(_stream(), batch_size=2, seq_len=8, seed=0, shuffle=False)
    x, _ = seq.next_batch()
    assert x[0, 0] == 0 and x[1, 0] == 8
    first = eval_batches(_stream(), batch_size=4, seq_len=8, steps=3)
    again = eval_batches(_stream(), batch_size=4, seq_len=8, steps=3)
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    with pytest.raises(ValueError, match="seq_len"):
        eval_batches(_stream(5), batch_size=1, seq_len=8, steps=1)


def test_encode_documents_joins_with_separator():
    tokens = encode_documents(ByteTokenizer(), ["ab", "c"])
    assert bytes(tokens.tolist()) == b"ab\n\nc" and tokens.dtype == torch.long
