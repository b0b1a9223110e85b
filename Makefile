# The README's two commands: `make demo` and `make test`. Everything lives in .venv.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install -q --disable-pip-version-check
# compat: a plain .pth path entry, no import hook: keeps ds-run's start-up cheap
EDITABLE := --config-settings editable_mode=compat

.PHONY: install install-test demo test lint docs bench bench-fanout bench-train bench-zero \
	bench-parallel bench-hf bench-checkpoint bench-onebit bench-moe bench-long-seq bench-elastic \
	bench-data-efficiency bench-compile bench-inference bench-zeropp plots clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned to the CPU wheel on disk: an unpinned torch would pull a multi-GB
# CUDA build. An existing torch (e.g. a CUDA build on a GPU machine) is kept.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) $(EDITABLE) -e .
	touch $@

$(VENV)/.installed-plot: pyproject.toml $(VENV)/.installed
	$(PIP) $(EDITABLE) -e '.[plot]'
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PIP) $(EDITABLE) -e '.[test]'
	touch $@

$(VENV)/.installed-docs: pyproject.toml $(VENV)/.installed
	$(PIP) $(EDITABLE) -e '.[docs]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/ds-run --num_gpus 2 examples/train_gpt.py \
		--deepspeed_config examples/configs/stage0.json --steps 20

# ruff and mypy over every file of the package ([tool.mypy] in pyproject.toml; torch is seen
# as Any, never followed, so that mypy stays fast)
lint: install-test
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

# the site (docs/, mkdocs.yml) into site/; --strict: a broken link or anchor, or a page
# missing from nav, fails the build (and so `make test`)
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# pytest exits 5 when it collects nothing: that fails this target like any other error
test: lint docs
	$(PY) -m pytest

bench: install
	$(PY) benchmarks/launch.py

bench-fanout: install
	$(PY) benchmarks/fanout.py

bench-train: install
	$(PY) benchmarks/train.py

bench-zero: install
	$(PY) benchmarks/zero.py
	$(PY) benchmarks/zero.py --adam

# engine.compile() (inductor) beside eager at ZeRO 0-3, deepshard and DeepSpeed 0.19.8 (from
# its side venv, /tmp/dsvenv), and torch.compile'd DDP: benchmarks/results/zero_compile.json
bench-compile: install
	$(PY) benchmarks/zero.py --compile

# deepshard.init_inference (tp 1/2, fp32/int8) beside HF generate and DeepSpeed 0.19.8's
# init_inference (its side venv, /tmp/dsvenv): GPT-2 small, greedy, batch 1 and 8, 128 tokens:
# benchmarks/results/inference.json
bench-inference: install-test
	$(PY) benchmarks/inference.py

bench-parallel: install
	$(PY) benchmarks/parallel.py

bench-hf: install-test
	$(PY) benchmarks/hf.py

# DeepSpeed 0.19.8 from its side venv (/tmp/dsvenv); its rows are skipped without it
bench-checkpoint: install
	$(PY) benchmarks/checkpoint.py

# two namespace hosts with tc-capped links (root, iproute2, openssh-server)
bench-onebit: install
	$(PY) benchmarks/onebit.py

# 4 gloo CPU ranks, ep 2 and 4; DeepSpeed 0.19.8 from its side venv (/tmp/dsvenv)
bench-moe: install
	$(PY) benchmarks/moe.py

# the small GPT to the baseline's validation loss with curriculum, random-LTD and both
bench-data-efficiency: install
	$(PY) benchmarks/data_efficiency.py

# the longest trainable sequence under a per-rank RSS budget, SP and ALST tiling vs not
bench-long-seq: install-test
	$(PY) benchmarks/long_seq.py

# namespace hosts with their own sshd (root, iproute2, openssh-server), ds-run vs torchrun
bench-elastic: install
	$(PY) benchmarks/elastic.py

# ZeRO++ and MiCS on 2 namespace hosts with tc-capped links (root), beside DeepSpeed's
bench-zeropp: install
	$(PY) benchmarks/zeropp.py

# the README's PNGs (docs/plots/) from the benchmarks' JSON records (benchmarks/results/)
plots: $(VENV)/.installed-plot
	$(PY) benchmarks/plot.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis site
