# The front door. `make help` lists the targets; every target installs the environment first if needed.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The lock: exact versions of every package, written by `make lock` from an environment whose tests passed.
CONSTRAINTS := requirements/constraints.txt
EXTRAS := test,notebooks,bench,dev

MODEL ?= vit_b16
DATA ?= synthetic
PROTOCOL ?= kfold5
TASK ?= bl1_vs_pa4
BIOVID_ROOT ?=
WEIGHTS ?=
ARGS ?=
LAUNCHER ?= local
JOBS ?=
RESUME ?=
VERBOSE ?=
RUN ?=
UNTRAINED ?=
IMG ?=
BATCH ?=
MLFLOW_PORT ?= 5000
# `make final` / `promote` / `predict` / `serve` / `export` (README: "Use a trained model")
VERSION ?=
VIDEO ?=
MODEL_URI ?=
FPS ?=
OUT ?=
FORMAT ?= onnx
SERVE_PORT ?= 5001
SERVE_PATH_ROOT ?=
# `make bench FINETUNE=full,lora`: fine-tuning strategies side by side (trainable weights, images/s, peak memory)
FINETUNE ?=
# `make server`: a tracking server for fold jobs on other nodes (LAUNCHER=slurm); see the README.
SERVER_HOST ?= 127.0.0.1
SERVER_PORT ?= 5000
SERVER_STORE ?= sqlite:///$(CURDIR)/mlflow.db
SERVER_ARTIFACTS ?= $(CURDIR)/mlartifacts
# Authentication (on by default where SERVER_HOST is not loopback): MLflow's basic-auth app, its users in SERVER_AUTH_DB;
# the first admin's password from $$MLFLOW_AUTH_ADMIN_PASSWORD or SERVER_ADMIN_PASSWORD_FILE (owner-only), never here.
SERVER_AUTH ?= auto
SERVER_AUTH_DB ?= sqlite:///$(CURDIR)/mlflow-auth.db
SERVER_AUTH_CONFIG ?= $(CURDIR)/mlflow-auth.ini
SERVER_DEFAULT_PERMISSION ?= READ
SERVER_ADMIN_PASSWORD_FILE ?=
SERVER_ALLOWED_HOSTS ?=
SERVER_CORS_ORIGINS ?=
SERVER_WORKERS ?=
SERVER_INSECURE ?=
export VERBOSE

# A backbone without its own file in configs/model/ is any timm model name.
MODEL_OVERRIDE = $(if $(wildcard configs/model/$(MODEL).yaml),model=$(MODEL),model=timm model.name=$(MODEL))
OVERRIDES = data=$(DATA) protocol=$(PROTOCOL) task=$(TASK) $(MODEL_OVERRIDE) \
	$(if $(BIOVID_ROOT),data.root=$(abspath $(BIOVID_ROOT))) $(if $(WEIGHTS),model.weights=$(abspath $(WEIGHTS))) \
	launcher=$(LAUNCHER) $(if $(JOBS),launcher.jobs=$(JOBS)) $(if $(RESUME),cv.resume=$(RESUME)) $(ARGS)
# `make table`: MODEL may name several backbones ("vit_b16 cvt_13"), each composed per task by the command itself.
TASKS ?=
TABLE_OVERRIDES = data=$(DATA) protocol=$(PROTOCOL) $(if $(BIOVID_ROOT),data.root=$(abspath $(BIOVID_ROOT))) \
	launcher=$(LAUNCHER) $(if $(JOBS),launcher.jobs=$(JOBS)) $(if $(RESUME),cv.resume=$(RESUME)) $(ARGS)
# A value as one shell word in single quotes (paths with spaces, quotes or non-ASCII characters).
quote = '$(subst ','\'',$(1))'
TRACKING_URI = $(or $(MLFLOW_TRACKING_URI),sqlite:///$(CURDIR)/mlflow.db)

.PHONY: help install lock data aug-preview cv embed pretrain tune compare table inspect calc ui server test lint notebooks bench bench-data clean clean-data \
	final promote predict serve export

help: ## list the targets
	@echo "Pain detection from facial video: fine-tune and compare backbones on BioVid Part A (or its synthetic twin)."
	@echo
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  make %-12s %s\n", $$1, $$2}'
	@echo
	@echo "Variables: MODEL=$(MODEL) DATA=$(DATA) PROTOCOL=$(PROTOCOL) TASK=$(TASK) BIOVID_ROOT= WEIGHTS= ARGS='key=value ...'"
	@echo "           LAUNCHER=$(LAUNCHER) (local|parallel|slurm) JOBS= RESUME= (never: a new run) VERBOSE= (1: all library output)"
	@echo "           TASKS= (table: default all five)"
	@echo "           RUN= (inspect: a parent run id) UNTRAINED= (inspect: 1 = untrained baseline) IMG= BATCH= (calc)"

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed ## create .venv and install the package, its extras and the locked versions of everything

lock: ## rewrite the lock requirements/constraints.txt from .venv (pip freeze; after make test passes)
	@test -x $(PY) || { echo "no $(VENV): run make install first" >&2; exit 2; }
	$(PY) scripts/lock.py --out $(CONSTRAINTS)
	touch $(VENV)/.installed

data: install ## prepare a dataset: DATA=synthetic (generated) or DATA=biovid BIOVID_ROOT=/path/to/PartA
	$(PY) -m pipeline data $(OVERRIDES)

aug-preview: install ## PNG grid of augmented crops, as MODEL sees them (reports/)
	$(PY) -m pipeline aug-preview $(OVERRIDES)

cv: install ## cross-validate MODEL on DATA/PROTOCOL/TASK, tracked in MLflow
	$(PY) -m pipeline cv $(OVERRIDES)

embed: install ## the embedding cache of MODEL frozen (WEIGHTS=): what make cv ARGS="model.finetune=frozen" reads
	$(PY) -m pipeline embed $(OVERRIDES)

# `make pretrain`: TARGET=au (action units, default) | identity; starts from WEIGHTS= if given, else model.pretrained
TARGET ?=
pretrain: install ## a starting point for MODEL trained here on faces outside DATA's people, for WEIGHTS= (TARGET=au|identity)
	$(PY) -m pipeline pretrain $(OVERRIDES) $(if $(TARGET),pretrain.target=$(TARGET))

# `make tune`: TRIALS= per study (default configs/tune/default.yaml), SCOPE=per_fold | shared (optimistic)
TRIALS ?=
SCOPE ?=
TUNED ?=
tune: install ## search MODEL's settings per fold with Optuna (TRIALS=20, SCOPE=per_fold), then its tuned CV
	$(PY) -m pipeline tune $(OVERRIDES) $(if $(TRIALS),tune.trials=$(TRIALS)) $(if $(SCOPE),tune.scope=$(SCOPE))

compare: install ## compare the backbones' latest CVs on DATA/PROTOCOL/TASK (TUNED=latest | versus_untuned | <budget>)
	$(PY) -m pipeline compare $(OVERRIDES) $(if $(TUNED),--tuned=$(TUNED))

table: install ## BioVid benchmark table: MODEL="vit_b16 cvt_13" on BL1 vs PA1..PA4 and five classes, beside published rows
	$(PY) -m pipeline table $(TABLE_OVERRIDES) --models="$(MODEL)" $(if $(TASKS),--tasks="$(TASKS)") \
		$(if $(TUNED),--tuned=$(TUNED) $(if $(TRIALS),--trials=$(TRIALS)) $(if $(SCOPE),--scope=$(SCOPE)))

inspect: install ## where MODEL's newest finished CV looks on each fold's test videos: rollout, Grad-CAM, region score
	$(PY) -m pipeline inspect $(OVERRIDES) $(if $(RUN),--run=$(RUN)) $(if $(UNTRAINED),--untrained=$(UNTRAINED))

calc: install ## size and cost of MODEL: shape trace, parameters by part, MACs, training memory (IMG=224 BATCH=32)
	$(PY) -m pipeline calc $(OVERRIDES) $(if $(IMG),model.img_size=$(IMG)) $(if $(BATCH),loader.batch_size=$(BATCH))

final: install ## one model of MODEL on all subjects with its latest finished CV's settings, registered (alias candidate)
	$(PY) -m pipeline final $(OVERRIDES) $(if $(RUN),--run=$(RUN))

promote: install ## make VERSION of pain-MODEL-TASK the champion (what predict and serve use)
	$(PY) -m pipeline promote $(OVERRIDES) --version=$(VERSION)

predict: install ## pain timeline (CSV + PNG) of VIDEO (a file or a folder) with the champion, MODEL_URI= or RUN=
	$(PY) -m pipeline predict $(OVERRIDES) --video=$(call quote,$(VIDEO)) \
		$(if $(MODEL_URI),--model_uri=$(call quote,$(MODEL_URI))) $(if $(RUN),--run=$(call quote,$(RUN))) \
		$(if $(FPS),predict.fps=$(FPS)) $(if $(OUT),--out=$(call quote,$(OUT)))

serve: install ## REST scoring server for the champion (or MODEL_URI=) on http://127.0.0.1:$(SERVE_PORT)/invocations
	$(PY) -m pipeline serve $(OVERRIDES) serve.port=$(SERVE_PORT) $(if $(MODEL_URI),--model_uri=$(call quote,$(MODEL_URI))) \
		$(if $(SERVE_PATH_ROOT),--path_root=$(call quote,$(SERVE_PATH_ROOT)))

export: install ## the network of MODEL_URI (default: the champion) as ONNX (FORMAT=onnx) into reports/export/
	$(PY) -m pipeline export $(OVERRIDES) $(if $(MODEL_URI),--model_uri=$(MODEL_URI)) --format=$(FORMAT) \
		$(if $(OUT),--out=$(OUT))

ui: install ## MLflow UI on http://127.0.0.1:$(MLFLOW_PORT) over the same store, with a password made for it
	$(PY) -m pipeline ui --port $(MLFLOW_PORT)

server: export SERVER_STORE := $(SERVER_STORE)
server: export SERVER_AUTH_DB := $(SERVER_AUTH_DB)
server: install ## MLflow tracking server for fold jobs on other nodes; basic auth on every host, loopback too
	$(PY) -m pipeline server --host $(call quote,$(SERVER_HOST)) --port $(SERVER_PORT) \
		--artifacts $(call quote,$(SERVER_ARTIFACTS)) --auth $(SERVER_AUTH) \
		--auth-config $(call quote,$(SERVER_AUTH_CONFIG)) \
		--default-permission $(SERVER_DEFAULT_PERMISSION) $(if $(SERVER_WORKERS),--workers $(SERVER_WORKERS)) \
		$(if $(SERVER_ADMIN_PASSWORD_FILE),--admin-password-file $(call quote,$(SERVER_ADMIN_PASSWORD_FILE))) \
		$(if $(SERVER_ALLOWED_HOSTS),--allowed-hosts $(call quote,$(SERVER_ALLOWED_HOSTS))) \
		$(if $(SERVER_CORS_ORIGINS),--cors-origins $(call quote,$(SERVER_CORS_ORIGINS))) \
		$(if $(filter 1,$(SERVER_INSECURE)),--insecure)

test: install ## run the test suite (the layers contract first: a wrong import fails in a second)
	$(VENV)/bin/lint-imports --no-logo
	$(PY) -m pytest

lint: install ## ruff, mypy over pipeline/ and the layers contract (settings in pyproject.toml; seconds)
	$(VENV)/bin/ruff check pipeline tests scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo

# One thread per kernel: the course's tensors are small, and OpenMP threads on a busy CPU slow them down many times.
notebooks: install ## execute the ViT course notebooks (notebooks/vit_course_*.ipynb) in place; fails on any error
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(VENV)/bin/jupyter-execute --inplace --timeout=600 notebooks/vit_course_*.ipynb

bench-data: install ## data benchmark: preprocessing throughput, detection rate, loader images/s
	$(PY) scripts/bench_data.py

bench: install ## training throughput: Lightning + DataModule against a bare PyTorch loop, per backbone (FINETUNE=full,lora)
	$(PY) scripts/bench_train.py $(if $(FINETUNE),--finetune=$(FINETUNE))

clean-data: ## delete generated data (data/)
	rm -rf data

clean: ## delete generated data, runs and reports (keeps .venv)
	rm -rf data mlflow.db mlartifacts reports lightning_logs runs
