# `make test` and `make demo` set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pitstop-installed

.PHONY: test demo bench venv clean etcd

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

test: $(STAMP) etcd
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/pitstop demo

bench: $(STAMP)
	$(VENV)/bin/pitstop bench groups --json
	$(VENV)/bin/pitstop bench recovery --json

clean:
	rm -rf $(VENV) runs
