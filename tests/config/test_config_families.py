"""A file of a ModelZoo family csx does not build is refused first, in one line naming the
family, whatever else it holds (issue 44 item 4); every refusal of a feature reads "is not
supported here"."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from csx_config import JobSpec, format_problems
from csx_config.families import MODEL_CLASSES, MODELS_NOT_BUILT, PROCESSOR_FAMILIES


def problems(params: dict) -> str:
    with pytest.raises(ValueError) as err:
        JobSpec.from_yaml(yaml.safe_dump(params))
    return format_problems(err.value)


# The shape of published files of each family (their own data and model keys, and for ViT the
# appliance flag it was first refused for), in the layouts ModelZoo publishes them in.
VIT_TRAINER = {"trainer": {"init": {
    "backend": {"backend_type": "CSX", "csx": {"debug": {"implicit_cast_cb16_to_fp32": True}}},
    "model": {"name": "vision_transformer", "num_classes": 1000, "image_size": [224, 224], "patch_size": [16, 16]}},
    "fit": {"train_dataloader": {"data_processor": "ImageNet1KProcessor", "num_classes": 1000,
                                 "image_size": [224, 224], "split": "train", "batch_size": 8}}}}
BERT_V1 = {"train_input": {"data_processor": "BertCSVDynamicMaskDataProcessor", "vocab_file": "v.txt",
                           "max_predictions_per_seq": 20, "masked_lm_prob": 0.15, "batch_size": 8},
           "model": {"disable_nsp": False, "mlm_loss_weight": 1.0, "hidden_size": 768}}
T5_TRAINER = {"trainer": {"init": {"model": {"name": "t5", "src_vocab_size": 32001, "d_kv": 64}},
                          "fit": {"train_dataloader": {"data_processor": "T5DynamicDataProcessor",
                                                       "src_vocab_file": "v.txt", "extra_ids": 100}}}}
LLAVA_TRAINER = {"trainer": {"init": {"model": {"name": "llava", "image_model": {"name": "ViTModel"}}},
                             "fit": {"train_dataloader": {"data_processor": "LlavaHDF5MapDataProcessor",
                                                          "img_data_dir": "imgs", "transforms": []}}}}
DIT_TRAINER = {"trainer": {"init": {"model": {"name": "dit", "num_diffusion_steps": 1000}},
                           "fit": {"train_dataloader": {"data_processor": "DiffusionLatentImageNet1KProcessor",
                                                        "num_classes": 1000, "image_channels": 4}}}}
ESM2_TRAINER = {"trainer": {"init": {"model": {"name": "esm2", "token_dropout": True}},
                            "fit": {"train_dataloader": {"data_processor": "BertHDF5DataProcessor"}}}}


@pytest.mark.parametrize(("params", "where", "family"), [
    (VIT_TRAINER, "trainer.init.model.name", "ViT"),
    (BERT_V1, "train_input.data_processor", "BERT"),
    (T5_TRAINER, "trainer.init.model.name", "T5"),
    (LLAVA_TRAINER, "trainer.init.model.name", "LLaVA"),
    (DIT_TRAINER, "trainer.init.model.name", "DiT"),
    (ESM2_TRAINER, "trainer.init.model.name", "ESM-2"),
], ids=["vit", "bert-1.x", "t5", "llava", "dit", "esm2"])
def test_a_family_not_built_is_refused_first_in_one_line(params, where, family):
    err = problems(params)
    lines = err.splitlines()
    assert lines[0] == "1 problem in params:" and len(lines) == 2, err
    assert lines[1].startswith(f"  - {where}: ") and family in lines[1], err
    assert "is not supported here" in lines[1] and "did you mean" not in err


@settings(max_examples=40)
@given(family=st.sampled_from(sorted(MODELS_NOT_BUILT)),
       junk=st.dictionaries(st.from_regex(r"[a-z]{3,10}", fullmatch=True), st.integers(), max_size=4),
       trainer=st.booleans())
def test_any_file_naming_a_family_not_built_has_that_one_problem(family, junk, trainer):
    """Whatever unknown or bad keys come with it, in either layout."""
    model = {"name": family, "hidden_size": -3, **junk}
    inputs = {"batch_size": 0, **junk}
    params = ({"trainer": {"init": {"model": model, **junk}, "fit": {"train_dataloader": inputs}}} if trainer
              else {"model": model, "train_input": inputs, "runconfig": junk})
    err = problems(params)
    assert err.count("\n  - ") == 1 and f"ModelZoo's {family} model" in err and "is not supported here" in err


def test_every_processor_of_a_family_not_built_names_that_family():
    for processor, family in PROCESSOR_FAMILIES.items():
        err = problems({"train_input": {"data_processor": processor, "batch_size": 0}})
        assert err.count("\n  - ") == 1 and f"ModelZoo's {family} model" in err, processor


def test_a_decoder_family_is_not_refused():
    for name in MODEL_CLASSES:
        assert JobSpec.model_validate({"model": {"name": name}}).model.name == name
