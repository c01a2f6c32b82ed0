# partc: two commands set everything up on a fresh machine.
#   make demo   create .venv (torch==2.13.0 first, then partc[dev]), compile, verify, check, draw and train an example
#   make test   same install, then ruff and mypy, then the default test suite (slow tests excluded)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PARTC := $(VENV)/bin/partc
STAMP := $(VENV)/.partc-installed

.PHONY: install lint demo test test-slow test-all bench bench-quality bench-measured bench-scale \
	bench-runtime bench-levers bench-zero bench-frontier bench-zoo bench-plots bench-all clean

install: $(STAMP)

# torch is pinned and installed first: an unpinned resolution would pull the CUDA build.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: install
	$(PARTC) compile examples/bert.py --batch-size 16 --stages 2 -o plans/bert
	$(PARTC) verify plans/bert/plan.yaml
	$(PARTC) check plans/bert/plan.yaml
	$(PARTC) show plans/bert/plan.yaml --png plans/bert/report.png --html plans/bert/report.html
	$(PARTC) launch plans/bert/plan.yaml --steps 3

# Lint and types: ruff (with import sorting, and a banned-api rule that keeps torch out of
# partc/solve) over the package, the CLI, the benchmarks and the tests, and mypy over the package,
# the CLI and the benchmarks (configuration in pyproject.toml).
lint: install
	$(PY) -m ruff check partc cli bench tests
	$(PY) -m mypy

# -n auto: one pytest worker per core (xdist); the workers share one profile cache for the run
# (tests/conftest.py), each entry measured once under its lock. --dist loadfile: each test file
# on one worker, so a module's fixtures (compiled plans, trained checkpoints) are built once, not
# once per worker (on 2 cores: 15 fixture builds of 2 s or more, 118 s, against 18 and 160 s
# with xdist's default distribution; the wall times, 665 and 803 s, were taken 15 minutes
# apart on a VM whose speed moved, and a fresh-clone run later read 803 s with it too).
# --durations: the slowest tests,
# for keeping the default run under 15 minutes (move a test to the slow set only where the
# default run covers its ground more cheaply, and say where)
test: lint
	$(PY) -m pytest -m "not slow" -q -n auto --dist loadfile --durations=30

test-slow: install
	$(PY) -m pytest -m slow -q

test-all: install
	$(PY) -m pytest -q

# Benchmarks (docs/benchmarks.md). `make bench` is the quick set (about 15 min on 2 cores); the
# full sets have their own targets, write raw rows to bench/results/ and bench-plots redraws
# docs/img/ from them.
RESULTS := bench/results

bench: install
	$(PY) bench/capture.py
	$(PY) bench/cost_model.py
	$(PY) bench/plan_quality.py --quick
	$(PY) bench/plan_measured.py --quick
	$(PY) bench/compile.py --quick --repeats 1
	$(PY) bench/compile_scale.py --sizes 0p1b,4p9b --clusters 4x8xv100-32gb --no-onnx
	$(PY) bench/check.py --repeats 1
	$(PY) bench/launch.py --quick

bench-quality: install
	$(PY) bench/plan_quality.py --json $(RESULTS)/plan_quality.json

# the machine's kernel speed mode before and after (bench/kernel_modes.py): on a shared VM a
# run that changed mode between profile and launch says nothing about the cost model; every case
# priced with this machine's own calibration (--calibrate), not the shipped configs' machine
bench-measured: install
	$(PY) bench/kernel_modes.py --every-core --windows 4 --json $(RESULTS)/kernel_modes_before.json
	$(PY) bench/plan_measured.py --processes 2,4 --repeats 3 --calibrate $(RESULTS)/calibrated \
		--json $(RESULTS)/plan_measured.json
	$(PY) bench/kernel_modes.py --every-core --windows 4 --json $(RESULTS)/kernel_modes_after.json

bench-scale: install
	$(PY) bench/compile_scale.py --json $(RESULTS)/compile_scale.json
	OMP_NUM_THREADS=1 $(PY) bench/search_cluster_size.py --json $(RESULTS)/search_cluster_size.json

bench-runtime: install
	$(PY) bench/launch.py --repeats 3 --json $(RESULTS)/launch.json

# memory levers: each one launched here (time cost, memory saved, vs predicted), and the largest
# models each set of levers can plan on RaNNC's and an H100 cluster (predicted)
bench-levers: install
	$(PY) bench/levers_measured.py --repeats 3 --json $(RESULTS)/levers_measured.json

bench-zero: install
	$(PY) bench/zero_stages.py --json $(RESULTS)/zero_stages.json
	$(PY) bench/zero_stages.py --replicas 4 --json $(RESULTS)/zero_stages_r4.json

bench-frontier: install
	$(PY) bench/frontier.py --json $(RESULTS)/frontier.json

# every Hugging Face architecture family from tiny configs through compile, verify, launch and
# check (129 rows for 53 architectures, about 95 min here; bench/model_zoo.py)
bench-zoo: install
	$(PY) bench/model_zoo.py --json $(RESULTS)/model_zoo.json

bench-plots: install
	$(PY) bench/plots.py

bench-all: bench-quality bench-measured bench-scale bench-runtime bench-levers bench-zero bench-frontier \
	bench-plots

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
