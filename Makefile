# semix front door. `make help` lists every target.
# Variables: CLASSES (preset or classes .txt), RECIPE (a preset whose recipe runs on CLASSES'
# data), OUT (runs root), RUN, LOSS, OBJECTIVE (finetune's; METHOD, its old name, still works),
# RUNS, MIXED, REPO, REVISION, PRIVATE, DRY_RUN, SET (extra key=value overrides), FORCE (clean),
# PYTEST_WORKERS (make test: processes, 0 = one).

SHELL      := /bin/bash
ROOT       := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.installed
CLASSES    ?= digits
OUT        ?= runs

# Make variables -> config overrides (empty ones vanish).
SETS := out=$(OUT) \
	$(if $(RUN),run=$(RUN)) $(if $(LOSS),loss=$(LOSS)) \
	$(if $(OBJECTIVE),objective=$(OBJECTIVE),$(if $(METHOD),method=$(METHOD))) \
	$(if $(RUNS),runs=$(RUNS)) $(if $(MIXED),mixed=$(MIXED)) $(if $(REPO),repo=$(REPO)) \
	$(if $(REVISION),revision=$(REVISION)) $(if $(PRIVATE),private=$(PRIVATE)) \
	$(if $(DRY_RUN),dry_run=$(DRY_RUN)) $(SET)
SEMIX := $(PY) -m pipeline
# the preset: CLASSES, with RECIPE's recipe when given (its run root: $(OUT)/CLASSES+RECIPE)
PRESET := --preset $(CLASSES) $(if $(RECIPE),--recipe $(RECIPE))

# Fashion-MNIST comes offline from Debian's package dataset-fashion-mnist (MIT); targets that
# read it install it first when it is missing and apt-get is usable (root).
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
DATA := $(if $(filter fashion-mnist,$(CLASSES)),fashion-mnist-data)

.DEFAULT_GOAL := help
.PHONY: help setup test test-all test-gpu bytes-check test-trackers test-reference lint format prepare fit-generator \
	chain generate annotate train evaluate finetune publish pull demo study bench clean \
	fashion-mnist-data shift ood

help: ## list every target
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

# A fresh .venv holds ~6.5 GB (PyPI's torch wheel is the CUDA build). Check the disk first, so a
# full one ends in one line naming the folder and the fix instead of pip's OSError mid-install.
VENV_GB ?= 7
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -c 'import os, shutil, sys; d = os.path.dirname(os.path.abspath("$(VENV)")); \
	free = shutil.disk_usage(d).free / 2**30; sys.exit(0 if free >= $(VENV_GB) else \
	f"semix setup: error: {free:.1f} GB free on the disk of {d}, a new $(VENV) needs ~$(VENV_GB) GB: " \
	f"free space there, or make VENV=/a/bigger/disk/venv ... (VENV_GB=0 skips this check)")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

setup: $(STAMP) ## create .venv and install the pinned dependencies (other targets do it too)

fashion-mnist-data: ## install Debian's dataset-fashion-mnist when missing (needs root + apt-get)
	@test -f $(FASHION_MNIST) || { command -v apt-get >/dev/null && test "$$(id -u)" = 0 && \
	  { apt-get install -y -qq dataset-fashion-mnist || \
	    { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; }; } >/dev/null 2>&1; } || \
	  echo "semix: could not install dataset-fashion-mnist (not root or no apt-get); prepare names the other ways"

# Tests spread over the cores (pytest-xdist; each worker's torch gets its share of them:
# tests/conftest.py). PYTEST_WORKERS=0 runs them in one process. loadgroup keeps a module marked
# xdist_group on one worker (its module fixtures built once); no reorder keeps conftest.py's
# heaviest-first order, so no long test starts last while the other worker idles.
PYTEST_WORKERS ?= auto
PYTEST_DIST = --dist loadgroup --no-loadscope-reorder
test: $(STAMP) ## fast CPU test tier (what CI runs)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_DIST)

test-all: $(STAMP) ## every CPU test, slow ones included
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_DIST) -m "not gpu"

test-gpu: $(STAMP) ## tests that need a CUDA GPU (without one: says "no GPU", exits 0)
	@$(PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; rc=$$?; \
	if [ $$rc = 0 ]; then $(PY) -m pytest -q -m gpu; \
	elif [ $$rc = 3 ]; then echo "semix test-gpu: no GPU (torch.cuda.is_available() is False): nothing to run"; \
	else exit $$rc; fi

# Installs into $(VENV): wandb and mlflow, pinned, with requirements.txt as constraints (the
# pinned set stays; pip moves a few unpinned packages mlflow caps: pyarrow, importlib_metadata,
# python-dateutil). trackio's test skips unless installed (`.[trackio]`, docs/train.md).
test-trackers: $(STAMP) ## install .[tracking] (wandb, mlflow) and run tests/test_tracking.py
	$(PY) -m pip install -q -c requirements.txt -e '.[tracking]'
	$(PY) -m pytest -q -rs tests/test_tracking.py

# Installs into $(VENV): the independent implementations evaluate's metrics and post-hoc
# calibrators are checked against (torch-uncertainty, relplot, netcal, uncertainty-calibration;
# docs/evaluate.md), with requirements.txt as constraints. Without them the tests skip.
test-reference: $(STAMP) ## install requirements-reference.txt and run tests/test_reference_metrics.py
	$(PY) -m pip install -q -c requirements.txt -r requirements-reference.txt
	$(PY) -m pytest -q -rs tests/test_reference_metrics.py

# Float bytes are a machine's: whether a change keeps an earlier commit's bytes is checked on one
# machine, both commits built from clean archives with this venv (docs/contributing.md).
bytes-check: $(STAMP) ## the chain at BASE and at HEAD (default HEAD) on this machine: equal data files? (SET= overrides; STUDY=1: BASE's study root rerun by HEAD)
	@test -n "$(BASE)" || { echo "semix bytes-check: error: name the earlier commit: make bytes-check BASE=<commit>" >&2; exit 2; }
	$(PY) tests/cross_commit.py $(BASE) $(or $(HEAD),HEAD) --preset $(CLASSES) $(if $(STUDY),--study) $(if $(SET),--set $(SET))

lint: $(STAMP) ## ruff check + format check + the import layers (import-linter)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports --no-cache --no-logo

format: $(STAMP) ## ruff fix + format
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

prepare: $(STAMP) $(DATA) ## real dataset -> OUT/<classes>/real/ (OUT: the runs root, default runs)
	$(SEMIX) prepare $(PRESET) --set $(SETS)

fit-generator: $(STAMP) ## train the in-house class-conditional UNet -> generator/
	$(SEMIX) fit-generator $(PRESET) --set $(SETS)

chain: $(STAMP) $(DATA) ## the whole generation chain, prepare to annotate (default: digits, offline) -> mixed/
	$(SEMIX) chain $(PRESET) --set $(SETS)

# The README's first command, kept: it runs the whole chain, not only the generate stage.
generate: chain ## the whole generation chain, as make chain (the generate stage alone: semix generate)

annotate: $(STAMP) ## soft labels for series/ -> mixed/
	$(SEMIX) annotate $(PRESET) --set $(SETS)

train: $(STAMP) $(DATA) ## train a classifier (RUN=name LOSS=ce|ls|focal|...|csm) -> train/<run>/
	$(SEMIX) train $(PRESET) --set $(SETS)

evaluate: $(STAMP) ## metrics, reliability diagram, report.md (RUN=name or RUNS=a,b,c)
	$(SEMIX) evaluate $(PRESET) --set $(SETS)

shift: $(STAMP) ## real/test corrupted at 5 severities, CIFAR-C layout (docs/shift.md) -> shift/test-c/
	$(SEMIX) shift $(PRESET) --set $(SETS)

ood: $(STAMP) ## far-OOD test sets: digits, uniform and gaussian noise (docs/shift.md) -> ood/<set>/
	$(SEMIX) ood $(PRESET) --set $(SETS)

finetune: $(STAMP) ## MaC-Cal or FeDLaS on a trained run (RUN=name OBJECTIVE=maccal|fedlas-ls|fedlas-mbls)
	$(SEMIX) finetune $(PRESET) --set $(SETS)

publish: $(STAMP) ## upload mixed/ to the Hub (REPO=user/name [PRIVATE=1] [DRY_RUN=1])
	$(SEMIX) publish $(PRESET) --set $(SETS)

pull: $(STAMP) ## download a published dataset (REPO=user/name [REVISION=...])
	$(SEMIX) pull $(PRESET) --set $(SETS)

demo: $(STAMP) $(DATA) ## digits: ce vs csm (3 seeds each) and calibration fine-tuning, report.md
	$(SEMIX) demo $(PRESET) --set $(SETS)

study: $(STAMP) $(DATA) ## every method x its seeds (ce, csm 10; csm3 5; others 3), paired intervals (CLASSES=fashion-mnist) -> study/
	$(SEMIX) study $(PRESET) --set $(SETS)

bench: $(STAMP) ## benchmarks -> bench/RESULTS.md
	$(PY) -m bench

# rm -rf on whatever OUT says, so: only a folder inside this checkout that git tracks nothing
# in; one outside it (OUT=/data/runs) only with FORCE=1; never the checkout, a folder holding
# it, .git or the virtual environment.
clean: ## remove OUT, the runs root (default runs/; keeps .venv); a folder outside the checkout needs FORCE=1
	@out='$(OUT)'; root=$$(cd -- '$(ROOT)' && pwd -P); \
	refuse() { echo "semix clean: $$1; nothing removed" >&2; exit 1; }; \
	[ -n "$$out" ] || refuse "OUT is empty"; \
	[ -e "$$out" ] || [ -L "$$out" ] || { echo "semix clean: $$out does not exist"; exit 0; }; \
	where=$$(cd -- "$$out" 2>/dev/null && pwd -P) || refuse "OUT=$$out is not a folder"; \
	above=$${where%/}; [ "$$where" != / ] || refuse "OUT=$$out is the root folder"; \
	case "$$root/" in "$$above"/*) refuse "OUT=$$out is this checkout or holds it";; esac; \
	venv=$$(cd -- "$$root" && cd -- '$(VENV)' 2>/dev/null && pwd -P) || venv=$$root/.git; \
	case "$$where/" in "$$root"/.git/*|"$$venv"/*) \
	  refuse "OUT=$$out is git's folder or the virtual environment";; esac; \
	case "$$where/" in \
	  "$$root"/*) ! git -C "$$root" ls-files --error-unmatch -- "$$where" >/dev/null 2>&1 || \
	    refuse "OUT=$$out holds files committed to git";; \
	  *) [ "$(FORCE)" = 1 ] || refuse "OUT=$$out ($$where) is outside this checkout ($$root): FORCE=1 removes it";; \
	esac; \
	rm -rf -- "$$out" && echo "semix clean: removed $$out"
