# `make test` and `make demo` set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pitstop-installed
# The second lane: megatron-core 0.19 with megatron.training (Megatron-LM's own pretrain loop)
LM_VENV  := .venv-lm
LM_PY    := $(LM_VENV)/bin/python
LM_STAMP := $(LM_VENV)/.pitstop-installed

.PHONY: test check demo bench venv venv-lm clean etcd

# Debian's etcd-server (3.4) for the etcd control-plane tests; the tests start it themselves
ETCD := $(shell command -v etcd 2>/dev/null)
etcd:
ifeq ($(ETCD),)
	@if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null || \
	  (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null); \
	else sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null; fi
	@command -v etcd >/dev/null
endif

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: this exact pin takes the local CPU wheel instead of a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	# DS_BUILD_OPS=0: DeepSpeed's sdist builds as pure Python (its ops compile on first use, if ever)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# megatron-core 0.19.2's only wheel is cp311 yet declares Requires-Python >=3.12: on this
# Python 3.11 it installs with --ignore-requires-python, beside the same local CPU torch as the
# main lane (pitstop.patches.py311 supplies the one 3.12 name it imports, typing.override).
$(LM_STAMP): pyproject.toml constraints-lm.txt
	test -x $(LM_PY) || $(PYTHON) -m venv $(LM_VENV)
	$(LM_PY) -m pip install -q --upgrade pip
	$(LM_PY) -m pip install -q torch==2.13.0
	$(LM_PY) -m pip install -q --ignore-requires-python -c constraints-lm.txt -e '.[lm-dev]'
	touch $(LM_STAMP)

venv-lm: $(LM_STAMP)

# Two lanes: megatron-core 0.16 and DeepSpeed (.venv), then Megatron-LM's own loop on 0.19 (.venv-lm)
# The unit tier (tests/unit: pure functions and single-process tests): what to run while editing
check: $(STAMP)
	$(PY) -m pytest -q tests/unit

# --durations: every run names its slowest tests (the suite's time on CI is a budget)
test: $(STAMP) $(LM_STAMP) etcd
	$(PY) -m pytest -q --durations=30
	$(LM_PY) -m pytest -q -c pytest-lm.ini --durations=10

demo: $(STAMP)
	$(VENV)/bin/pitstop demo

bench: $(STAMP)
	$(VENV)/bin/pitstop bench groups --json
	$(VENV)/bin/pitstop bench recovery --json

clean:
	rm -rf $(VENV) $(LM_VENV) runs
