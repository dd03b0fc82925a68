# tunelab: the same commands CI runs. Every target installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
# The torch build to install before anything else asks for torch (a CPU wheel here; on a CUDA
# machine e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128").
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tunelab-installed
# A second environment with the oldest versions pyproject.toml allows (see test-min).
VENV_MIN ?= .venv-min
PY_MIN := $(VENV_MIN)/bin/python
STAMP_MIN := $(VENV_MIN)/.tunelab-installed

export TORCHAO_FORCE_SKIP_LOADING_SO_FILES ?= 1
# llama-cpp-python (dev extra) builds llama.cpp from source: for any x86-64 CPU (no -march=native,
# so a wheel pip cached on one machine runs on another), without the multimodal library.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

.PHONY: install demo test test-min lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	rm -rf outputs/demo
	$(VENV)/bin/tunelab run --nproc_per_node 2 lora_finetune_distributed --config tiny/lora output_dir=outputs/demo
	$(VENV)/bin/tunelab run generate --config tiny/generate model.path=outputs/demo/epoch_2

# Two workers, each test file whole on one (its module-scoped runs made once); the shared
# session runs of tests/recipes/conftest.py are made once for both (a file lock).
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The fast tests against the declared floors: the same torch, and transformers, peft, tensorboard
# and wandb pinned at their `>=` floors in the dev extras (.ci/floor_requirements.py reads them).
$(STAMP_MIN): pyproject.toml .ci/floor_requirements.py
	test -x $(PY_MIN) || $(PYTHON) -m venv $(VENV_MIN)
	$(PY_MIN) -m pip install -q --upgrade pip
	$(PY_MIN) -m pip install -q $(TORCH_SPEC)
	$(PY_MIN) -m pip install -q -e ".[dev]" $$($(PY_MIN) .ci/floor_requirements.py)
	touch $(STAMP_MIN)

test-min: $(STAMP_MIN)
	$(PY_MIN) -m pytest -q -m "not slow" tests

lint: install
	$(VENV)/bin/ruff check framework recipes tests bench
	$(VENV)/bin/ruff format --check framework recipes tests bench

format: install
	$(VENV)/bin/ruff check --fix framework recipes tests bench
	$(VENV)/bin/ruff format framework recipes tests bench

bench: install
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(VENV_MIN) outputs .pytest_cache .ruff_cache
