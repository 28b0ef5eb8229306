# Two set-up commands: `make pretrain` (install, data, train) and `make test`. ARGS are config overrides.
VENV ?= .venv
PYTHON ?= python3
KEEL := $(VENV)/bin/keel
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install data pretrain test test-fast tensorboard eval generate bench gpu-check maxlr sweep redundancy paper clean

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

# The max-LR report of docs/experiments.md: Table 1 at two depths and the ablations, SEEDS each. At miniature
# (default) it trains here; interrupted, rerun it to continue (finished runs are skipped). PAPER_SCALE=1 writes
# the same grids at paper scale as SLURM arrays instead (PAPER_SBATCH: #SBATCH options, space-separated); gather
# each with `keel maxlr collect DIR`. ARGS (options or overrides) go to every grid, e.g. data=fineweb_edu.
SEEDS ?= 1,2,3,4,5
PAPER_OUT ?= runs/paper
ABLATIONS := --schemes keel --alphas '1,sqrt(L),L/2,L,2L,L*L,L**0.25' \
	--variant noinner=model.scheme=keel,model.keel_inner_norm=false --variant v2=model.scheme=keel,model.keel_first_block=v2
ABLATION_PAIRS := keel-aL:keel-a1,keel-aL:keel-asqrtL,keel-aL:keel-aLdiv2,keel-aL:keel-a2L,keel-aL:keel-aLxL,keel-aL:keel-aLxx0.25,keel-aL:noinner,keel-aL:v2
ifeq ($(PAPER_SCALE),1)
SHALLOW := model=paper_d64 trainer=gpu
DEEP := --depths 256 model=paper_d64 trainer=gpu
EMIT := --emit slurm $(foreach option,$(PAPER_SBATCH),--sbatch=$(option))
else
SHALLOW :=
DEEP := --depths 48 model.width=32 model.n_heads=4 model.seq_len=128 trainer.micro_batch_size=8 trainer.threads=1
EMIT :=
endif
paper: install
	$(KEEL) data $(filter data=% data.%,$(ARGS))
	$(KEEL) maxlr --seeds $(SEEDS) --out $(PAPER_OUT)/table1-d16 $(EMIT) $(SHALLOW) $(ARGS)
	$(KEEL) maxlr --schemes keel,preln,postln,deepnorm --seeds $(SEEDS) --out $(PAPER_OUT)/table1-deep $(EMIT) $(DEEP) $(ARGS)
	$(KEEL) maxlr $(ABLATIONS) --seeds $(SEEDS) --out $(PAPER_OUT)/ablations $(EMIT) $(SHALLOW) $(ARGS)
	$(if $(filter 1,$(PAPER_SCALE)),,$(KEEL) maxlr collect $(PAPER_OUT)/ablations --pairs $(ABLATION_PAIRS))

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
