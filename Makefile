# Two set-up commands: `make pretrain` (install, data, train) and `make test`. ARGS are config overrides.
VENV ?= .venv
PYTHON ?= python3
KEEL := $(VENV)/bin/keel
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install data pretrain test test-fast tensorboard eval generate bench gpu-check maxlr sweep redundancy clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

data: install
	$(KEEL) data $(ARGS)

pretrain: data
	$(KEEL) pretrain $(ARGS)

test: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test-fast: install
	$(VENV)/bin/pytest -q -m 'not slow' $(PYTEST_ARGS)

# Experiments (docs/experiments.md). ARGS mixes the command's options and config overrides; only data.* ones reach `keel data`.
maxlr sweep: install
	$(KEEL) data $(filter data=% data.%,$(ARGS))
	$(KEEL) $@ $(ARGS)

redundancy: install
	$(KEEL) redundancy $(ARGS)

bench: install
	$(KEEL) bench $(ARGS)

# GPU acceptance in one command, a few minutes on one GPU (docs/bench.md); DEVICE=cpu: the same checks at tiny sizes.
DEVICE ?= cuda
gpu-check: install
	$(KEEL) gpu-check --device $(DEVICE) --out out/gpu-check-$(DEVICE) $(ARGS)

# Downstream tasks on a checkpoint with lm-eval (docs/evaluation.md); ARGS adds lm-eval options (e.g. --limit 200).
CKPT ?= runs/default/checkpoints/last.ckpt
TASKS ?= keel_generated
eval: install
	$(KEEL) eval --model_args checkpoint=$(CKPT) --tasks $(TASKS) --output_path out/eval $(ARGS)

# Sample from a checkpoint: make generate PROMPT="def main(" ARGS="--temperature 0"
PROMPT ?= def
generate: install
	$(KEEL) generate checkpoint=$(CKPT) --prompt "$(PROMPT)" $(ARGS)

tensorboard: install
	$(VENV)/bin/tensorboard --logdir runs

clean:
	rm -rf runs out
