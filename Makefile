# Two set-up commands: `make pretrain` (install, data, train) and `make test`. ARGS are config overrides.
VENV ?= .venv
PYTHON ?= python3
KEEL := $(VENV)/bin/keel
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install data pretrain test test-fast tensorboard eval bench maxlr sweep redundancy clean

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

tensorboard: install
	$(VENV)/bin/tensorboard --logdir runs

clean:
	rm -rf runs out
