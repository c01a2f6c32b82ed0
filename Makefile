# partc: two commands set everything up on a fresh machine.
#   make demo   create .venv (torch==2.13.0 first, then partc[dev]), compile, verify, check, draw and train an example
#   make test   same install, then the default test suite (slow tests excluded)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PARTC := $(VENV)/bin/partc
STAMP := $(VENV)/.partc-installed

.PHONY: install demo test test-slow test-all bench clean

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

test: install
	$(PY) -m pytest -m "not slow" -q

test-slow: install
	$(PY) -m pytest -m slow -q

test-all: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/capture.py
	$(PY) bench/cost_model.py
	$(PY) bench/solver.py
	$(PY) bench/compile.py
	$(PY) bench/check.py
	$(PY) bench/launch.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
