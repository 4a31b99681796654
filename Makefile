# The two commands: `make demo` and `make test`. Both create .venv and install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

export NO_ALBUMENTATIONS_UPDATE := 1
export HF_HUB_OFFLINE := 1
export WANDB_MODE := disabled
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: install demo test test-all lint format stop clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	# img2dataset pulls the dataclasses==0.6 backport, which shadows the standard library and
	# breaks the Prefect server (dataclass() got an unexpected keyword argument 'slots').
	$(PY) -m pip uninstall -y -q dataclasses
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m flows.cli demo

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check .

format: install
	$(PY) -m ruff format .

stop: install
	$(PY) -m flows.cli stop

clean: stop
	rm -rf data
