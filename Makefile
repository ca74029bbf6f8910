# The front door. `make help` lists the targets; every target installs the environment first if needed.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# What a user gives is data, never make code nor shell code: a variable a user sets is frozen to its text as written
# (`freeze`, through $(value): make never expands a `$(shell ...)` in it) and reaches a recipe only as one quoted shell
# word (`quote`). A default written here is expanded once, as this Makefile means it (`literal`).
literal = $(if $(filter file,$(origin $(1))),$($(1)),$(value $(1)))
freeze = $(if $(filter undefined,$(origin $(1))),,$(eval override $(1) := $$(call literal,$(1))))
# Every command-line variable first, before anything reads one, each still exported as make exports it (make expands
# an exported variable's value for a recipe's environment: `$(shell ...)` ran there even where no recipe used it).
$(foreach name,$(.VARIABLES),$(if $(filter command,$(origin $(name))),$(call freeze,$(name))$(eval export $(name))))

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The locks, written by `make lock` from an environment whose tests passed: every package's version and the SHA-256
# of its file (lock.txt: what install installs, pip refusing any other file), the versions alone (constraints.txt: for
# `pip install -c` where another build of a package is wanted), and what a served model needs (serving.txt).
LOCK := requirements/lock.txt
CONSTRAINTS := requirements/constraints.txt

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
# `make table`: TASKS="bl1_vs_pa1 bl1_vs_pa2" (default: all five)
TASKS ?=
# `make pretrain`: TARGET=au (action units, default) | identity; starts from WEIGHTS= if given, else model.pretrained
TARGET ?=
# `make tune`: TRIALS= per study (default configs/tune/default.yaml), SCOPE=per_fold | shared (optimistic)
TRIALS ?=
SCOPE ?=
TUNED ?=
# `make power`: EFFECT= null | temporal | baseline | graded | aa | aa_signal | curve (configs/power/default.yaml),
# REPEATS= twins or replicates (default 20)
EFFECT ?= temporal
REPEATS ?=
# `make final` / `promote` / `predict` / `serve` / `export` (README: "Use a trained model")
VERSION ?=
VIDEO ?=
# `make predict REFERENCE=<folder>`: the person's own recordings, for a personalised model (personalise=)
REFERENCE ?=
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
# The variables above (each given a default with ?=: tests/test_makefile.py checks this list holds them all) and the
# one `make ui` reads: one from the environment is frozen as one from the command line is, a default here expanded.
USER_VARIABLES := PYTHON MODEL DATA PROTOCOL TASK BIOVID_ROOT WEIGHTS ARGS LAUNCHER JOBS RESUME VERBOSE RUN UNTRAINED \
	IMG BATCH MLFLOW_PORT TASKS TARGET TRIALS SCOPE TUNED EFFECT REPEATS VERSION VIDEO REFERENCE MODEL_URI FPS OUT \
	FORMAT SERVE_PORT SERVE_PATH_ROOT FINETUNE SERVER_HOST SERVER_PORT SERVER_STORE SERVER_ARTIFACTS SERVER_AUTH \
	SERVER_AUTH_DB SERVER_AUTH_CONFIG SERVER_DEFAULT_PERMISSION SERVER_ADMIN_PASSWORD_FILE SERVER_ALLOWED_HOSTS \
	SERVER_CORS_ORIGINS SERVER_WORKERS SERVER_INSECURE MLFLOW_TRACKING_URI
$(foreach name,$(USER_VARIABLES),$(call freeze,$(name)))
export VERBOSE

define newline


endef
# A value as one shell word: in single quotes, a ' as '\'' and a newline as $'\n' (make ends a recipe line at a
# newline, even inside quotes, and hands what follows to a shell of its own).
quote = '$(subst $(newline),'$$'\n'',$(subst ','\'',$(1)))'
# `$(call if_set,--run=,RUN)`: the word --run=<RUN>, quoted, where RUN is set; nothing where it is empty.
if_set = $(if $($(2)),$(call quote,$(1)$($(2))))
# A path made absolute (a fold job on another node does not share this folder): make's abspath for a path without
# whitespace (abspath splits at whitespace); a relative path with whitespace gets $(CURDIR)/ in front.
absolute = $(if $(word 2,x$(1)x),$(if $(filter ^/%,$(firstword ^$(1))),$(1),$(CURDIR)/$(1)),$(abspath $(1)))

# A backbone without its own file in configs/model/ is any timm model name: the command decides which
# (pipeline/utils/config.backbone_choice).
MODEL_OVERRIDE = $(call quote,model=$(MODEL))
ROOT_OVERRIDE = $(if $(BIOVID_ROOT),$(call quote,data.root=$(call absolute,$(BIOVID_ROOT))))
# ARGS= holds key=value words as a shell writes them (ARGS="a=1 b='x y'"): it reaches the command as one argument,
# --args=..., which the command splits as a shell would (shlex), running nothing in it.
LAUNCH_OVERRIDES = $(call quote,launcher=$(LAUNCHER)) $(call if_set,launcher.jobs=,JOBS) \
	$(call if_set,cv.resume=,RESUME) $(call if_set,--args=,ARGS)
WEIGHTS_OVERRIDE = $(if $(WEIGHTS),$(call quote,model.weights=$(call absolute,$(WEIGHTS))))
OVERRIDES = $(call quote,data=$(DATA)) $(call quote,protocol=$(PROTOCOL)) $(call quote,task=$(TASK)) $(MODEL_OVERRIDE) \
	$(ROOT_OVERRIDE) $(WEIGHTS_OVERRIDE) $(LAUNCH_OVERRIDES)
# `make table`: MODEL may name several backbones ("vit_b16 cvt_13"), each composed per task by the command itself;
# WEIGHTS= (one file) starts every one of them from it.
TABLE_OVERRIDES = $(call quote,data=$(DATA)) $(call quote,protocol=$(PROTOCOL)) $(ROOT_OVERRIDE) $(WEIGHTS_OVERRIDE) \
	$(LAUNCH_OVERRIDES)
TRACKING_URI = $(or $(MLFLOW_TRACKING_URI),sqlite:///$(CURDIR)/mlflow.db)
# Each command's own options, one recipe line each (make echoes a recipe as written: a mistake's answer stays short)
TABLE_OPTIONS = $(call quote,--models=$(MODEL)) $(call if_set,--tasks=,TASKS) \
	$(if $(TUNED),$(call if_set,--tuned=,TUNED) $(call if_set,--trials=,TRIALS) $(call if_set,--scope=,SCOPE))
PREDICT_OPTIONS = $(call quote,--video=$(VIDEO)) $(call if_set,--model_uri=,MODEL_URI) $(call if_set,--run=,RUN) \
	$(call if_set,predict.fps=,FPS) $(call if_set,--out=,OUT) $(call if_set,--reference=,REFERENCE)
SERVE_OPTIONS = $(call quote,serve.port=$(SERVE_PORT)) $(call if_set,--model_uri=,MODEL_URI) \
	$(call if_set,--path_root=,SERVE_PATH_ROOT)
EXPORT_OPTIONS = $(call if_set,--model_uri=,MODEL_URI) $(call if_set,--run=,RUN) $(call quote,--format=$(FORMAT)) \
	$(call if_set,--out=,OUT)
SERVER_OPTIONS = --host $(call quote,$(SERVER_HOST)) --port $(call quote,$(SERVER_PORT)) \
	--artifacts $(call quote,$(SERVER_ARTIFACTS)) --auth $(call quote,$(SERVER_AUTH)) \
	--auth-config $(call quote,$(SERVER_AUTH_CONFIG)) --default-permission $(call quote,$(SERVER_DEFAULT_PERMISSION)) \
	$(if $(SERVER_WORKERS),--workers $(call quote,$(SERVER_WORKERS))) \
	$(if $(SERVER_ADMIN_PASSWORD_FILE),--admin-password-file $(call quote,$(SERVER_ADMIN_PASSWORD_FILE))) \
	$(if $(SERVER_ALLOWED_HOSTS),--allowed-hosts $(call quote,$(SERVER_ALLOWED_HOSTS))) \
	$(if $(SERVER_CORS_ORIGINS),--cors-origins $(call quote,$(SERVER_CORS_ORIGINS))) \
	$(if $(filter 1,$(SERVER_INSECURE)),--insecure)
# The environment's programs, each path one quoted word
QUOTED_PY = $(call quote,$(PY))
QUOTED_BIN = $(call quote,$(VENV)/bin)

.PHONY: help install lock data aug-preview cv embed pretrain tune compare table power fidelity check-thresholds inspect calc ui server test lint notebooks bench bench-data clean clean-data \
	final promote predict serve export gpu-check

help: ## list the targets
	@echo "Pain detection from facial video: fine-tune and compare backbones on BioVid Part A (or its synthetic twin)."
	@echo
	@grep -E '^[a-z-]+:.*## ' $(foreach makefile,$(MAKEFILE_LIST),$(call quote,$(makefile))) | awk 'BEGIN {FS = ":.*## "} {printf "  make %-12s %s\n", $$1, $$2}'
	@echo
	@printf '%s\n' $(call quote,Variables: MODEL=$(MODEL) DATA=$(DATA) PROTOCOL=$(PROTOCOL) TASK=$(TASK) BIOVID_ROOT= WEIGHTS= ARGS='key=value ...')
	@printf '%s\n' $(call quote,           LAUNCHER=$(LAUNCHER) (local|parallel|slurm) JOBS= RESUME= (never: a new run) VERBOSE= (1: all library output))
	@echo "           TASKS= (table: default all five)"
	@echo "           RUN= (inspect: a parent run id) UNTRAINED= (inspect: 1 = untrained baseline) IMG= BATCH= (calc)"

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(call quote,$(PYTHON)) -m venv $(call quote,$(VENV))
	$(QUOTED_PY) -m pip install --quiet --require-hashes --no-deps -r $(call quote,$(LOCK))
	$(QUOTED_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(QUOTED_PY) -m pip check
	$(QUOTED_PY) -m pipeline.data.blazeface  # predict's second face detector: its weights file, SHA-256 checked
	touch $(call quote,$@)

install: $(VENV)/.installed ## create .venv: every locked package, each file checked against its SHA-256, then the project

lock: ## rewrite the locks in requirements/ from .venv (versions, SHA-256s, the served model's part; after make test)
	@test -x $(QUOTED_PY) || { echo $(call quote,no $(VENV): run make install first) >&2; exit 2; }
	$(QUOTED_PY) scripts/lock.py --out $(call quote,$(CONSTRAINTS)) --hashed-out $(call quote,$(LOCK))
	touch $(call quote,$(VENV)/.installed)

data: install ## prepare a dataset: DATA=synthetic (generated) or DATA=biovid BIOVID_ROOT=/path/to/PartA
	$(QUOTED_PY) -m pipeline data $(OVERRIDES)

aug-preview: install ## PNG grid of augmented crops, as MODEL sees them (reports/)
	$(QUOTED_PY) -m pipeline aug-preview $(OVERRIDES)

cv: install ## cross-validate MODEL on DATA/PROTOCOL/TASK, tracked in MLflow
	$(QUOTED_PY) -m pipeline cv $(OVERRIDES)

embed: install ## the embedding cache of MODEL frozen (WEIGHTS=): what make cv ARGS="model.finetune=frozen" reads
	$(QUOTED_PY) -m pipeline embed $(OVERRIDES)

pretrain: install ## a starting point for MODEL trained here on faces outside DATA's people, for WEIGHTS= (TARGET=au|identity)
	$(QUOTED_PY) -m pipeline pretrain $(OVERRIDES) $(call if_set,pretrain.target=,TARGET)

tune: install ## search MODEL's settings per fold with Optuna (TRIALS=20, SCOPE=per_fold), then its tuned CV
	$(QUOTED_PY) -m pipeline tune $(OVERRIDES) $(call if_set,tune.trials=,TRIALS) $(call if_set,tune.scope=,SCOPE)

compare: install ## compare the backbones' latest CVs on DATA/PROTOCOL/TASK (TUNED=latest | versus_untuned | <budget>)
	$(QUOTED_PY) -m pipeline compare $(OVERRIDES) $(call if_set,--tuned=,TUNED)

table: install ## BioVid benchmark table: MODEL="vit_b16 cvt_13" on BL1 vs PA1..PA4 and five classes, beside published rows
	$(QUOTED_PY) -m pipeline table $(TABLE_OVERRIDES) $(TABLE_OPTIONS)

power: install ## error rates of make compare's test on BioVid-scale twins with a planted effect (EFFECT=null|temporal|aa|curve REPEATS=20)
	$(QUOTED_PY) -m pipeline power $(OVERRIDES) $(call quote,power.effect=$(EFFECT)) $(call if_set,power.repeats=,REPEATS)

fidelity: install ## how hard DATA's twin is: a reference method's curve beside BioVid's published one (reports/fidelity/)
	$(QUOTED_PY) -m pipeline fidelity $(call quote,data=$(DATA)) $(call if_set,--args=,ARGS)

check-thresholds: install ## the default CVs' folds at eval.threshold's rule: none with video AUROC >= 0.85 under 0.65 balanced accuracy (RULE= RUN=)
	$(QUOTED_PY) scripts/check_default_thresholds.py $(call if_set,--rule=,RULE) $(call if_set,--run=,RUN)

inspect: install ## where MODEL's newest finished CV looks on each fold's test videos: rollout, Grad-CAM, region score
	$(QUOTED_PY) -m pipeline inspect $(OVERRIDES) $(call if_set,--run=,RUN) $(call if_set,--untrained=,UNTRAINED)

calc: install ## size and cost of MODEL: shape trace, parameters by part, MACs, training memory (IMG=224 BATCH=32)
	$(QUOTED_PY) -m pipeline calc $(OVERRIDES) $(call if_set,model.img_size=,IMG) $(call if_set,loader.batch_size=,BATCH)

final: install ## one model of MODEL on all subjects with its latest finished CV's settings, registered (alias candidate)
	$(QUOTED_PY) -m pipeline final $(OVERRIDES) $(call if_set,--run=,RUN)

promote: install ## make VERSION of pain-MODEL-TASK the champion (what predict and serve use)
	$(QUOTED_PY) -m pipeline promote $(OVERRIDES) $(call quote,--version=$(VERSION))

predict: install ## pain timeline (CSV + PNG) of VIDEO (a file or a folder) with the champion, MODEL_URI= or RUN=; REFERENCE=
	$(QUOTED_PY) -m pipeline predict $(OVERRIDES) $(PREDICT_OPTIONS)

serve: install ## REST scoring server for the champion (or MODEL_URI=) on http://127.0.0.1:$(SERVE_PORT)/invocations
	$(QUOTED_PY) -m pipeline serve $(OVERRIDES) $(SERVE_OPTIONS)

export: install ## the network of MODEL_URI= or RUN=<fold or final run> (default: the champion) as ONNX (FORMAT=onnx) into reports/export/
	$(QUOTED_PY) -m pipeline export $(OVERRIDES) $(EXPORT_OPTIONS)

ui: install ## MLflow UI on http://127.0.0.1:$(MLFLOW_PORT) over the same store, with a password made for it
	$(QUOTED_PY) -m pipeline ui --port $(call quote,$(MLFLOW_PORT))

server: export SERVER_STORE := $(SERVER_STORE)
server: export SERVER_AUTH_DB := $(SERVER_AUTH_DB)
server: install ## MLflow tracking server for fold jobs on other nodes; basic auth on every host, loopback too
	$(QUOTED_PY) -m pipeline server $(SERVER_OPTIONS)

test: install ## run the test suite on two workers (the layers contract first: a wrong import fails in a second)
	$(QUOTED_BIN)/lint-imports --no-logo
	$(QUOTED_PY) -m pytest -n 2 --dist loadgroup

lint: install ## ruff, mypy over pipeline/ and scripts/ and the layers contract (settings in pyproject.toml; seconds)
	$(QUOTED_BIN)/ruff check pipeline tests scripts
	$(QUOTED_BIN)/mypy
	$(QUOTED_BIN)/lint-imports --no-logo

# One thread per kernel: the course's tensors are small, and OpenMP threads on a busy CPU slow them down many times.
notebooks: install ## execute the ViT course notebooks (notebooks/vit_course_*.ipynb) in place; fails on any error
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(QUOTED_BIN)/jupyter-execute --inplace --timeout=600 notebooks/vit_course_*.ipynb

bench-data: install ## data benchmark: preprocessing throughput, detection rate, loader images/s
	$(QUOTED_PY) scripts/bench_data.py

bench: install ## training throughput: Lightning + DataModule against a bare PyTorch loop, per backbone (FINETUNE=full,lora)
	$(QUOTED_PY) scripts/bench_train.py $(call if_set,--finetune=,FINETUNE)

gpu-check: install ## on one CUDA GPU within 8 minutes: device, bench, a ViT-B/16 fold, detection, predict, as JSON (reports/gpu_check/)
	@$(QUOTED_PY) scripts/gpu_check.py

clean-data: ## delete generated data (data/)
	rm -rf data

clean: ## delete generated data, runs and reports (keeps .venv)
	rm -rf data mlflow.db mlartifacts reports lightning_logs runs
