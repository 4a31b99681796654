# The two commands: `make demo` and `make test`. Both create .venv and install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

export NO_ALBUMENTATIONS_UPDATE := 1
export HF_HUB_OFFLINE := 1
export WANDB_MODE := disabled
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: install demo test test-all lint format stop clean system-deps scale-out

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

# Two workers: CI has 2 cores, and half of the suite waits on Prefect servers and subprocesses.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(PY) -m ruff check .

format: install
	$(PY) -m ruff format .

stop: install
	$(PY) -m flows.cli stop

clean: stop
	rm -rf data

# Debian packages of the operate tests (tests/operate): PostgreSQL for the shared server,
# Redis for its message broker, Chromium for the dashboard test, docker-compose to validate
# infra/docker-compose.yml. Each
# is installed only if missing, and only where apt-get can run (root or passwordless sudo);
# a test whose package is missing skips with the reason.

system-deps:
	@missing=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || missing="$$missing postgresql"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	{ command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1; } || missing="$$missing docker-compose"; \
	if [ -z "$$missing" ]; then echo "system packages present"; exit 0; fi; \
	if ! command -v apt-get >/dev/null; then echo "no apt-get: not installing$$missing (those tests skip)"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "not root: not installing$$missing (those tests skip)"; exit 0; fi; \
	echo "installing$$missing"; \
	$$SUDO apt-get update -q >/dev/null && \
	DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing >/dev/null \
	  || echo "apt-get install$$missing failed (those tests skip)"

# docs/scale-out.md steps 1-6 on loopback: Postgres, server with auth, pool, 2 workers, runs.
scale-out: install
	$(PY) infra/scale_out_local.py
