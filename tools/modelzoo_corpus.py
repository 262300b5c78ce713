"""Build tests/fixtures/modelzoo_corpus/ from a clone of Cerebras/modelzoo.

    python tools/modelzoo_corpus.py GIT_DIR [--out tests/fixtures/modelzoo_corpus]

Reads every YAML config of the decoder-only LM families (gpt2, gpt3 with Cerebras_GPT, muP and
sparsity/, llama, mistral, btlm, bloom, jais, gptj with GPT-NeoX and its continuous pretraining,
falcon, starcoder with its fine-tunes, santacoder, mpt, gemma2, mixtral with the MoE configs,
dpo) in every release tag, keeps each distinct content once (under
the first release that published it), and writes it as
``<family>/<layout>/<release>_<name>.yaml``: the published keys and values, comments dropped.
A file without a sparsity section gets one taken from ModelZoo's own sparsity configs of the
same layout, and says so in its header. The TensorFlow configs (``transformers/tf/``) are left
out: that backend was dropped in 2.0 and runs nothing here.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import zlib
from pathlib import Path
from typing import Any

import yaml

FAMILIES = ("gpt2", "gpt3", "llama", "mistral", "btlm", "bloom", "jais", "gptj", "falcon", "starcoder",
            "santacoder", "mpt", "gemma2", "mixtral", "dpo")
CONFIG_PATH = re.compile(rf"/(?P<family>{'|'.join(FAMILIES)})/(?:(?:fine_tuning/)?continuous_pretraining/)?"
                         r"configs/(?P<name>.+)\.ya?ml$")


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], check=True, capture_output=True,
                          text=True).stdout


def release_key(tag: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", tag)) or (99,)


def release_name(tag: str) -> str:
    return "r" + ".".join(re.findall(r"\d+", tag)) if tag != "main" else "main"


def layout_of(data: dict[str, Any], tag: str) -> str:
    if "trainer" in data:
        return "trainer"
    return "params_v1" if release_key(tag) < (2,) else "params_v2"


def published_files(repo: str) -> list[tuple[str, str, str, str]]:
    """(tag, family, name, blob) of every decoder config, oldest release first."""
    tags = sorted((t for t in git(repo, "tag").split() if release_key(t) >= (1,)), key=release_key)
    rows = []
    for tag in [*tags, "main"]:
        for line in git(repo, "ls-tree", "-r", tag).splitlines():
            meta, path = line.split("\t", 1)
            match = CONFIG_PATH.search(path)
            if match and "/tf/" not in path:
                name = match["name"].replace("/", "_")
                rows.append((tag, match["family"], name, meta.split()[2]))
    return rows


def sparsity_donors(corpus: dict[tuple, dict]) -> dict[str, list[tuple[str, Any]]]:
    """ModelZoo's own sparsity sections per layout (params 1.8/2.0 form, params 2.3 form, trainer)."""
    donors: dict[str, list[tuple[str, Any]]] = {"params_v1": [], "params_v2": [], "trainer": []}
    for (family, name, _), item in sorted(corpus.items(), key=lambda kv: kv[1]["tag_key"]):
        data, layout = item["data"], item["layout"]
        section = own_sparsity(data)
        if section is None or "pretraining" not in name or not isinstance(section, dict):
            continue
        source = f"{item['release']} {family}/{name}"
        donors[layout].append((source, section))
        if layout == "params_v2" and "type" in section:  # the 1.8/2.0 form also fits 1.x files
            donors["params_v1"].append((source, section))
    return donors


def own_sparsity(data: dict[str, Any]) -> Any:
    if "trainer" in data:
        trainer = data["trainer"]
        return trainer.get("init", {}).get("sparsity") if isinstance(trainer, dict) else None
    return data.get("sparsity")


def add_sparsity(data: dict[str, Any], section: Any) -> None:
    if "trainer" in data:
        data["trainer"].setdefault("init", {})["sparsity"] = section
    else:
        data["sparsity"] = section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("git_dir")
    parser.add_argument("--out", default="tests/fixtures/modelzoo_corpus")
    args = parser.parse_args()
    corpus: dict[tuple, dict] = {}
    for tag, family, name, blob in published_files(args.git_dir):
        data = yaml.safe_load(git(args.git_dir, "cat-file", "-p", blob))
        if not isinstance(data, dict):
            continue
        key = (family, name, json.dumps(data, sort_keys=True, default=str))
        corpus.setdefault(key, {"data": data, "release": release_name(tag), "tag_key": release_key(tag),
                                "layout": layout_of(data, tag)})
    donors = sparsity_donors(corpus)
    out = Path(args.out)
    for (family, name, _), item in sorted(corpus.items()):
        header = f"# Cerebras/modelzoo {item['release']}: {family}/configs/{name}.yaml (comments dropped)\n"
        path = out / family / item["layout"] / f"{item['release']}_{name}.yaml"
        if own_sparsity(item["data"]) is None:
            # Chosen by the file's own path, so a file keeps its donor as the corpus grows.
            choice = zlib.crc32(str(path.relative_to(out)).encode())
            source, section = donors[item["layout"]][choice % len(donors[item["layout"]])]
            add_sparsity(item["data"], section)
            header += f"# sparsity section added from ModelZoo's {source}\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + yaml.safe_dump(item["data"], sort_keys=False, width=100), encoding="utf-8")
    print(f"{len(corpus)} files under {out}")


if __name__ == "__main__":
    main()
