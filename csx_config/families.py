"""Which ModelZoo model families csx builds (``model.name`` -> model class), and the one-line
refusal of a file of any other family.

A file of a family not built here is refused before anything else of it is read: every other
line would be about keys of a model csx does not build (a ViT file's data keys, a BERT file's
masking options), which only hides the one fact that matters. The family is the file's
``model.name`` (ModelZoo's registry name), ``model.dpo`` for 2.x DPO files (which name no
model), else the data processor its ``train_input`` / ``eval_input`` names, since 1.x and early
2.x files name no model and their processor belongs to one family.
"""

from __future__ import annotations

from typing import Any

# model.name -> the ModelZoo model class it selects (the class decides the decoder block).
MODEL_CLASSES: dict[str, str] = {
    **dict.fromkeys(("gpt2", "gpt3", "llama", "mistral", "btlm", "bloom", "jais", "starcoder",
                     "santacoder", "mpt", "gemma2", "mixtral"), "GPT2LMHeadModel"),
    "gptj": "GPTJModel", "falcon": "GPTJModel"}
# ModelZoo's registry names of the models csx does not build (releases 1.x to 2.10), with what
# each is; the refusal names it.
MODELS_NOT_BUILT: dict[str, str] = {
    "dpo": "DPO, a policy model and a frozen reference model trained on preference pairs",
    "bert": "BERT, an encoder", "bert/classifier": "a BERT sequence classifier",
    "bert/extractive_summarization": "BERTSUM, a BERT extractive summarizer",
    "bert/token_classifier": "a BERT token classifier",
    "t5": "T5, an encoder-decoder", "transformer": "the encoder-decoder Transformer",
    "esm2": "ESM-2, a protein encoder", "esm2/classification": "an ESM-2 sequence classifier",
    "dpr": "DPR, a retrieval encoder pair", "dpr/embedding_generation": "DPR's embedding generator",
    "llava": "LLaVA, a vision-language model", "multimodal_simple": "a vision-language model",
    "vision_transformer": "ViT, an image classifier", "dit": "DiT, a diffusion transformer",
    "dino": "DINO, a self-supervised image encoder",
    "generic_image_encoders": "a self-supervised image encoder", "fc_mnist": "an MNIST classifier"}
# Data processors only a family not built here reads -> that family (ModelZoo's registry).
PROCESSOR_FAMILIES: dict[str, str] = {
    **dict.fromkeys(("BertCSVDataProcessor", "BertCSVDynamicMaskDataProcessor", "BertHDF5DataProcessor"),
                    "bert"),
    **dict.fromkeys(("MNLIDataProcessor", "SST2DataProcessor"), "bert/classifier"),
    "BertSumCSVDataProcessor": "bert/extractive_summarization",
    "BertTokenClassifierDataProcessor": "bert/token_classifier",
    "DpoHDF5DataProcessor": "dpo", "DPRHDF5DataProcessor": "dpr",
    **dict.fromkeys(("DPREmbedGenHDF5DataProcessor", "DPREmbedGenHDF5MapDataProcessor"),
                    "dpr/embedding_generation"),
    **dict.fromkeys(("T5DynamicDataProcessor", "T5HDF5DataProcessor"), "t5"),
    "TransformerDynamicDataProcessor": "transformer",
    "LlavaHDF5MapDataProcessor": "llava",
    **dict.fromkeys(("MultimodalSimpleHDF5MapDataProcessor", "MultimodalRawDatasetProcessor"),
                    "multimodal_simple"),
    "ImageNet1KProcessor": "vision_transformer", "DiffusionLatentImageNet1KProcessor": "dit",
    "DinoImageDataProcessor": "dino", "BaseImageDataProcessor": "generic_image_encoders",
    **dict.fromkeys(("MNISTDataProcessor", "MNISTMapDataProcessor"), "fc_mnist")}
BUILT = f"csx builds ModelZoo's decoder-only LMs ({', '.join(sorted(MODEL_CLASSES))})"


def not_built(name: Any) -> str:
    """Why a ``model.name`` is refused: the family it is, or that it is none of ModelZoo's."""
    what = MODELS_NOT_BUILT.get(name) if isinstance(name, str) else None
    if what is None:
        return f"model.name {name!r} is not supported here: it is none of ModelZoo's models; {BUILT}"
    return f"ModelZoo's {name} model ({what}) is not supported here; {BUILT}"


def model_name(model: Any) -> Any:
    """The family a model section names: ``name``, or ``dpo`` for a 2.x DPO file's
    ``model.dpo`` (which names none); None when it names none."""
    if not isinstance(model, dict):
        return None
    return "dpo" if "dpo" in model and model.get("name") is None else model.get("name")


def family_refusal(params: dict[str, Any]) -> tuple[tuple[str, ...], str] | None:
    """The one problem of a params-layout file of a family not built here (its location and
    message), or None for a decoder LM."""
    name = model_name(params.get("model"))
    if name is not None:
        return None if isinstance(name, str) and name in MODEL_CLASSES else (("model", "name"), not_built(name))
    for section in ("train_input", "eval_input"):
        processor = params.get(section, {}).get("data_processor") if isinstance(params.get(section), dict) else None
        family = PROCESSOR_FAMILIES.get(processor) if isinstance(processor, str) else None
        if family is not None:
            return ((section, "data_processor"),
                    f"{processor} reads the data of ModelZoo's {family} model ({MODELS_NOT_BUILT[family]}), "
                    f"which is not supported here; {BUILT}")
    return None
