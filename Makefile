# Two set-up commands: `make pretrain` (install, data, train) and `make test`. ARGS are config overrides.
# `make install` installs what training, evaluation and export need (keel[hf]); `make test` adds the test extra.
VENV ?= .venv
PYTHON ?= python3
KEEL := $(VENV)/bin/keel
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install install-test data pretrain test test-extended test-fast test-lowest lint format tensorboard eval generate export bench gpu-check maxlr sweep redundancy paper tune-lr clean

# TORCH_INDEX: a PyTorch wheel index to take torch from, for a GPU driver older than PyPI's build needs (README,
# "Scaling out"), e.g. `make install TORCH_INDEX=https://download.pytorch.org/whl/cu126` on a fresh venv. torchvision
# (litdata's) comes from it too, built for the same torch, and the rest is installed with both held at those builds.
TORCH_INDEX ?=
TORCH_PINS := $(VENV)/torch-pins.txt

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
ifneq ($(TORCH_INDEX),)
	$(VENV)/bin/pip install --quiet --index-url $(TORCH_INDEX) torch torchvision
	$(VENV)/bin/pip freeze | grep -E '^(torch|torchvision)==' > $(TORCH_PINS)
endif
	$(VENV)/bin/pip install --quiet$(if $(TORCH_INDEX), --constraint $(TORCH_PINS)) -e '.[hf]'
	touch $@

# the test extra (pytest, moto, trl, peft and every optional logger and backend, all tested), over the install
$(VENV)/.installed-test: $(VENV)/.installed
	$(VENV)/bin/pip install --quiet$(if $(TORCH_INDEX), --constraint $(TORCH_PINS)) -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

data: install
	$(KEEL) data $(ARGS)

# the config is checked first (a fraction of a second): a typo in ARGS is said by keel pretrain, before keel data
pretrain: install
	@$(KEEL) pretrain --print-config $(ARGS) > /dev/null
	$(KEEL) data $(ARGS)
	$(KEEL) pretrain $(ARGS)

test: install-test
	$(VENV)/bin/pytest -q -m 'not extended' $(PYTEST_ARGS)

# The multi-process variants and the Summary over the committed records, which `make test` leaves out to stay under 15
# minutes here; CI runs them after it
test-extended: install-test
	$(VENV)/bin/pytest -q -m extended $(PYTEST_ARGS)

# ruff's formatter and linter (pyproject.toml's [tool.ruff]): `make format` rewrites, `make lint` (CI) only checks
lint: install-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: install-test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The numerics guard's committed values (tests/numerics_guard.json, checked by tests/test_numerics_guard.py in `make
# test`), regenerated on this machine after a change meant to move the numerics: then rerun the committed records
# a verdict rests on, or show that their verdicts survive (docs/experiments.md, "Set-up")
.PHONY: numerics-guard
numerics-guard: install-test
	PYTHONPATH=tests $(VENV)/bin/python -m keeltest.numerics --write

test-fast: install-test
	$(VENV)/bin/pytest -q -m 'not slow and not extended' $(PYTEST_ARGS)

# The declared lower bounds, tested: a throwaway venv with exactly the oldest version pyproject.toml allows of each
# direct dependency, then the fast suite. torchvision, which litdata pulls in for images only, is removed: a CUDA
# build of it beside a CPU torch breaks torchmetrics' import.
LOWEST_VENV ?= .venv-lowest
test-lowest:
	rm -rf $(LOWEST_VENV) && $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/pip install --quiet --upgrade pip
	$(PYTHON) .ci/lowest-constraints.py > $(LOWEST_VENV)/constraints.txt
	$(LOWEST_VENV)/bin/pip install --quiet -c $(LOWEST_VENV)/constraints.txt -e '.[test]'
	$(LOWEST_VENV)/bin/pip uninstall --quiet --yes torchvision
	$(LOWEST_VENV)/bin/pip list --format=freeze > $(LOWEST_VENV)/installed.txt
	$(LOWEST_VENV)/bin/pytest -q -m 'not slow and not extended' $(PYTEST_ARGS)

# Experiments (docs/experiments.md). ARGS mixes the command's options and config overrides; only data.* ones reach `keel data`.
maxlr sweep: install
	$(KEEL) data $(filter data=% data.%,$(ARGS))
	$(KEEL) $@ $(ARGS)

redundancy: install
	$(KEEL) redundancy $(ARGS)

# The paper's grids (docs/experiments.md), defined in src/keel/experiments/grids.py and run by `keel paper-run GRID`
# (`--dry-run` prints the command): `make paper-<grid>` one, `make paper` all of the max-LR report, then `keel
# paper-report`; `make paper-linear` those on the paper's protocol; `make paper-trained` the trained models' (LR
# sweeps, layer use; `paper-redundancy-<grid>` after its grid); `make paper-transfer` the width-transfer grids,
# Pre-LN's depth rule and 16 blocks at 256 blocks' steps (docs/lr-transfer.md). Every grid is resumable (rerun to
# continue; finished runs are skipped); `make -j2 paper` runs two grids at once (each probe uses one thread).
# PAPER_SCALE=1 writes the two Table 1 grids at paper scale as SLURM arrays instead (PAPER_SBATCH: #SBATCH options,
# space-separated); gather each with `keel maxlr collect DIR`. ARGS (options or overrides) go to every training grid,
# e.g. data=fineweb_edu; the grids' settings (SEEDS, TREND_SEEDS, ... in grids.py, given here) replace their defaults.
PAPER_OUT ?= runs/paper
PAPER_SETTINGS := SEEDS TREND_SEEDS WIDE_SEEDS TRAINED_SEEDS TRAINED_STEPS TRAINED_STEPS_D256 TRAINED_WARMUP LRS_D16 \
	LRS_D64 TUNED_LRS TUNED_LRS_D256 TUNED_SHORT_LRS DEPTH_RULE_LRS TRANSFER_SEEDS TRANSFER_STEPS TRANSFER_LRS \
	TRANSFER_LRS_SP256
PAPER_RUN = $(strip $(KEEL) paper-run --out $(PAPER_OUT) $(foreach name,$(PAPER_SETTINGS),$(if $(filter-out \
	undefined,$(origin $(name))),--set '$(name)=$($(name))')) $(if $(filter 1,$(PAPER_SCALE)),--paper-scale \
	$(foreach option,$(PAPER_SBATCH),--sbatch=$(option))))
# Every scheme trains from its own literature's init (model.init=auto); the shared-init comparison is the same grids
# with one init for all, e.g. `make paper ARGS=model.init=normal PAPER_OUT=runs/paper-shared-init`; name that tree in
# PAPER_SHARED_INIT and the report adds what depends on the init.
PAPER_SHARED_INIT ?=
.PHONY: paper-data paper-linear paper-trained paper-transfer
# a set's grids' targets, listed once keel is installed; PAPER_SCALE=1: the two Table 1 grids only, and no report
PAPER_SET = $(or $(addprefix paper-,$(shell $(PAPER_RUN) --list $(1))),$(error keel paper-run --list $(1): no grid))
paper: install
	$(MAKE) --no-print-directory $(call PAPER_SET,$@)
	$(if $(filter 1,$(PAPER_SCALE)),,$(KEEL) paper-report $(PAPER_OUT) $(if $(PAPER_SHARED_INIT),--shared-init $(PAPER_SHARED_INIT)))

paper-linear paper-trained paper-transfer: install
	$(MAKE) --no-print-directory $(call PAPER_SET,$@)
	$(KEEL) paper-report $(PAPER_OUT)

# The LR tuning sweep of docs/lr-transfer.md's recipe (the transfer grid at the base width under mup, into PAPER_OUT):
# it ends by printing the LR to pass to the large run (optim.lr, with model.parametrization=mup model.mup_base_width=64)
tune-lr: paper-transfer-w64-mup

paper-data: install
	$(KEEL) data $(filter data=% data.%,$(ARGS))

# paper-<grid>: `keel paper-run GRID` after `keel data`. paper-redundancy-<grid>: layer use over the grid's final
# checkpoints that have no rows yet, after paper-<grid> (rerunning a finished grid skips its runs), without ARGS.
paper-redundancy-%: paper-%
	$(PAPER_RUN) redundancy-$*

# (make takes the first pattern rule whose prerequisites are all targets: for paper-redundancy-<grid>, the one above)
.SECONDEXPANSION:
PAPER_FIRST = $(if $(filter redundancy-%,$*),no-such-target,paper-data)
paper-%: $$(PAPER_FIRST)
	$(PAPER_RUN) $* -- $(ARGS)

bench: install
	$(KEEL) bench $(ARGS)

# GPU acceptance in one command, a few minutes on one GPU (docs/bench.md); DEVICE=cpu: the same checks at tiny sizes.
DEVICE ?= cuda
gpu-check: install
	$(KEEL) gpu-check --device $(DEVICE) --out out/gpu-check-$(DEVICE) $(ARGS)

# Downstream tasks on a checkpoint with lm-eval (docs/evaluation.md); ARGS adds lm-eval options (e.g. --limit 200).
CKPT ?= runs/default/checkpoints/last.ckpt
TASKS ?= keel_generated
# its results file, named after the checkpoint and the tasks: out/eval/<run>-<checkpoint>-<tasks>_<date>.json
comma := ,
EVAL_RUN = $(notdir $(patsubst %/checkpoints,%,$(patsubst %/,%,$(dir $(CKPT)))))
EVAL_NAME = $(EVAL_RUN)-$(basename $(notdir $(CKPT)))-$(subst $(comma),+,$(TASKS))
eval: install
	$(KEEL) eval --model_args checkpoint=$(CKPT) --tasks $(TASKS) --output_path out/eval/$(EVAL_NAME).json $(ARGS)

# Sample from a checkpoint: make generate PROMPT="def main(" ARGS="--temperature 0"
PROMPT ?= def
generate: install
	$(KEEL) generate checkpoint=$(CKPT) --prompt "$(PROMPT)" $(ARGS)

# A checkpoint as a Hugging Face model directory (docs/export.md): make export CKPT=... EXPORT_DIR=out/hf ARGS="--dtype bf16"
EXPORT_DIR ?= out/hf
export: install
	$(KEEL) export checkpoint=$(CKPT) --out $(EXPORT_DIR) $(ARGS)

tensorboard: install
	$(VENV)/bin/tensorboard --logdir runs

clean:
	rm -rf runs out
