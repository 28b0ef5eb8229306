# Two set-up commands: `make pretrain` (install, data, train) and `make test`. ARGS are config overrides.
VENV ?= .venv
PYTHON ?= python3
KEEL := $(VENV)/bin/keel
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install data pretrain test test-extended test-fast test-lowest tensorboard eval generate export bench gpu-check maxlr sweep redundancy paper clean

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
	$(VENV)/bin/pip install --quiet$(if $(TORCH_INDEX), --constraint $(TORCH_PINS)) -e '.[test]'
	touch $@

install: $(VENV)/.installed

data: install
	$(KEEL) data $(ARGS)

pretrain: data
	$(KEEL) pretrain $(ARGS)

test: install
	$(VENV)/bin/pytest -q -m 'not extended' $(PYTEST_ARGS)

# The multi-process variants `make test` leaves out to stay under 15 minutes here; CI runs them after it
test-extended: install
	$(VENV)/bin/pytest -q -m extended $(PYTEST_ARGS)

test-fast: install
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

# The max-LR report of docs/experiments.md, every grid resumable (rerun to continue; finished runs are skipped),
# `make -j2 paper` runs two grids at once (each probe uses one thread). PAPER_SCALE=1 writes the two Table 1
# grids at paper scale as SLURM arrays instead (PAPER_SBATCH: #SBATCH options, space-separated); gather each with
# `keel maxlr collect DIR`. ARGS (options or overrides) go to every grid, e.g. data=fineweb_edu.
SEEDS ?= 1,2,3,4,5
TREND_SEEDS ?= 1,2,3
WIDE_SEEDS ?= 1,2
MUP_WIDTHS := 32 64 128 256
PAPER_OUT ?= runs/paper
NARROW := model.n_heads=4 model.seq_len=128 trainer.micro_batch_size=8 trainer.threads=1
ifeq ($(PAPER_SCALE),1)
SHALLOW := model=paper_d64 trainer=gpu
DEEP := --depths 256 model=paper_d64 trainer=gpu
EMIT := --emit slurm $(foreach option,$(PAPER_SBATCH),--sbatch=$(option))
else
SHALLOW :=
DEEP := --depths 64 model.width=32 $(NARROW)
EMIT :=
endif
MAXLR = $(KEEL) maxlr --out $(PAPER_OUT)/$(subst paper-,,$@)
ALL_GRIDS := linear-d16 linear-d64 linear-gentle-d16 hold-d16-fast hold-d16-slow hold-d64-fast hold-d64-slow linear-depth-d16 \
	linear-depth-d256 linear-width-w128 linear-width-w256 table1-d16 table1-d64 depth-d16 depth-d256 width-w128 \
	width-w256 batch-8x ramp-2x hybridnorm deep1024 deep1024-nogain nogain-d16 nogain-d64 nogain-d256 \
	$(addprefix mup-width-w,$(MUP_WIDTHS))
# PAPER_SCALE=1: the two Table 1 grids only, emitted for a cluster (the others are miniature experiments)
PAPER_GRIDS := $(if $(filter 1,$(PAPER_SCALE)),table1-d16 table1-d64,$(ALL_GRIDS))
.PHONY: paper-data paper-linear $(addprefix paper-,$(ALL_GRIDS))
# Every scheme trains from its own literature's init (model.init=auto); the shared-init comparison is the same grids
# with one init for all, e.g. `make paper ARGS=model.init=normal PAPER_OUT=runs/paper-shared-init`; name that tree in
# PAPER_SHARED_INIT and the report adds what depends on the init.
PAPER_SHARED_INIT ?=
paper: $(addprefix paper-,$(PAPER_GRIDS))
	$(if $(filter 1,$(PAPER_SCALE)),,$(KEEL) paper-report $(PAPER_OUT) $(if $(PAPER_SHARED_INIT),--shared-init $(PAPER_SHARED_INIT)))

paper-data: install
	$(KEEL) data $(filter data=% data.%,$(ARGS))

# Table 1 on the paper's protocol (the primary one): a linear warm-up from 0 at 1e-4 per step (peak / steps), the
# held-out loss every 5 steps (LR resolution 5e-4); every scheme at 16 blocks x 64 and at 64 blocks x 32.
# `make -j2 paper-linear`: these two, then the hold map (the same probes at half and twice the slope; Keel and
# Pre-LN), then the trends on this protocol.
LINEAR = --ramp linear --eval-every 5
SLOPE_1E4 = $(LINEAR) --peak-lr 0.4 --steps 4000
SLOPE_2E4 = $(LINEAR) --peak-lr 0.4 --steps 2000
SLOPE_5E5 = $(LINEAR) --peak-lr 0.4 --steps 8000
SLOPE_2E5 = $(LINEAR) --peak-lr 0.1 --steps 4000
paper-linear: paper-linear-d16 paper-linear-d64 paper-linear-gentle-d16 paper-hold-d16-fast paper-hold-d16-slow paper-hold-d64-fast \
	paper-hold-d64-slow paper-linear-depth-d16 paper-linear-depth-d256 paper-linear-width-w128 paper-linear-width-w256
	$(KEEL) paper-report $(PAPER_OUT)
# Keel and Pre-LN over SEEDS, the Post-LN family over TREND_SEEDS (its limits are far below); HybridNorm, which does
# not learn at this slope, in paper-linear-gentle-d16. `--only` picks the runs of the one grid (the same sweep.json).
comma := ,
RUNS = $(foreach scheme,$(1),$(foreach seed,$(subst $(comma), ,$(2)),--only $(scheme)-d$(3)-s$(seed)))
LINEAR_RUNS = $(call RUNS,keel preln,$(SEEDS),$(1)) $(call RUNS,postln deepnorm mixln,$(TREND_SEEDS),$(1))
paper-linear-d16: paper-data
	$(MAXLR) --seeds $(SEEDS) $(SLOPE_1E4) $(call LINEAR_RUNS,16) $(ARGS)
paper-linear-d64: paper-data
	$(MAXLR) --seeds $(SEEDS) $(SLOPE_1E4) --depths 64 model.width=32 $(NARROW) $(call LINEAR_RUNS,64) $(ARGS)
# the Post-LN family at 16 x 64 on a 4x gentler slope (2.5e-5 per step, resolution 1.25e-4): at 1e-4 per step
# HybridNorm passes its limit before it has learned (docs/experiments.md)
paper-linear-gentle-d16: paper-data
	$(MAXLR) --schemes postln,deepnorm,hybridnorm,mixln --seeds $(TREND_SEEDS) $(SLOPE_2E5) $(ARGS)
paper-hold-d16-fast: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(TREND_SEEDS) $(SLOPE_2E4) $(ARGS)
paper-hold-d16-slow: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(TREND_SEEDS) $(SLOPE_5E5) $(ARGS)
paper-hold-d64-fast: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(TREND_SEEDS) $(SLOPE_2E4) --depths 64 model.width=32 $(NARROW) $(ARGS)
paper-hold-d64-slow: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(TREND_SEEDS) $(SLOPE_5E5) --depths 64 model.width=32 $(NARROW) $(ARGS)
paper-linear-depth-d16: paper-data
	$(MAXLR) --schemes keel,preln,postln --seeds $(TREND_SEEDS) $(SLOPE_1E4) --depths 16 model.width=32 $(NARROW) $(ARGS)
paper-linear-depth-d256: paper-data
	$(MAXLR) --schemes keel,preln,postln --seeds $(WIDE_SEEDS) $(SLOPE_1E4) --depths 256 model.width=32 $(NARROW) $(ARGS)
paper-linear-width-w128: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(TREND_SEEDS) $(SLOPE_1E4) --depths 16 model.width=128 $(NARROW) $(ARGS)
paper-linear-width-w256: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(WIDE_SEEDS) $(SLOPE_1E4) --depths 16 model.width=256 $(NARROW) $(ARGS)
# Table 1 on the geometric ramp (the second protocol): every scheme at 16 blocks x 64; the four the paper runs deep
# at 64 blocks x 32
paper-table1-d16: paper-data
	$(MAXLR) --seeds $(SEEDS) $(EMIT) $(SHALLOW) $(ARGS)
paper-table1-d64: paper-data
	$(MAXLR) --schemes keel,preln,postln,deepnorm --seeds $(SEEDS) $(EMIT) $(DEEP) $(ARGS)
# Trends: depth at width 32 (64 blocks: table1-d64), width at 16 blocks (64: table1-d16, 32: depth-d16),
# 8x the tokens per step at 16 x 64
paper-depth-d16: paper-data
	$(MAXLR) --schemes keel,preln,postln --seeds $(TREND_SEEDS) --depths 16 model.width=32 $(NARROW) $(ARGS)
paper-depth-d256: paper-data
	$(MAXLR) --schemes keel,preln,postln --seeds $(WIDE_SEEDS) --depths 256 model.width=32 $(NARROW) $(ARGS)
paper-width-w128: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(TREND_SEEDS) --depths 16 model.width=128 $(NARROW) $(ARGS)
paper-width-w256: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(WIDE_SEEDS) --depths 16 model.width=256 $(NARROW) $(ARGS)
# LR transfer across width under muP (docs/model.md#mup-modelparametrization), base width 64 (the miniature's: there
# mup is sp): the width trend's grids again with model.parametrization=mup, against the sp ones above
MUP := model.parametrization=mup model.mup_base_width=64
$(addprefix paper-mup-width-w,$(MUP_WIDTHS)): paper-mup-width-w%: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(if $(filter 256,$*),$(WIDE_SEEDS),$(TREND_SEEDS)) --depths 16 \
		model.width=$* $(NARROW) $(MUP) $(ARGS)
paper-batch-8x: paper-data
	$(MAXLR) --schemes keel,preln --seeds $(TREND_SEEDS) --depths 16 model.width=64 $(NARROW) trainer.micro_batch_size=64 $(ARGS)
# The criterion's check: the ramp twice as slow (a real LR limit stays at its LR, an artefact moves with the step)
paper-ramp-2x: paper-data
	$(MAXLR) --schemes keel,preln --seeds 1,2 --steps 1120 --eval-every 40 callbacks.stability.spike_patience=80 $(ARGS)
# HybridNorm with the shared init and with its authors' (Megatron-scaled output projections), on a ramp from 1e-4
paper-hybridnorm: paper-data
	$(MAXLR) --schemes hybridnorm --variant hybridnorm-megatron=model.scheme=hybridnorm,model.init=megatron \
		--seeds $(TREND_SEEDS) --start-lr 1e-4 --steps 720 model.init=normal $(ARGS)
# Past 1000 layers: 1,024 blocks (L = 2,048) at a fixed LR that works at 64 blocks, three schemes; then Keel
# without the outer norms' per-channel gains (docs/experiments.md, section 3)
DEEP1024 = $(KEEL) sweep --depths 1024 --lrs 0.01 --out $(PAPER_OUT)/$(subst paper-,,$@) model.width=32 \
	model.n_heads=4 model.seq_len=64 trainer.micro_batch_size=8 trainer.threads=1 trainer.max_steps=200 \
	trainer.val_every_n_steps=25 trainer.val_batches=8 trainer.checkpoint_every_n_steps=50 eval.enabled=false \
	callbacks.grad_norms.every_n_steps=25 callbacks.grad_norms.heatmap_every_n_steps=50 \
	callbacks.stability.stop_on_failure=false trainer.progress_bar=false
paper-deep1024: paper-data
	$(DEEP1024) --schemes keel,preln,postln $(ARGS)
paper-deep1024-nogain: paper-data
	$(DEEP1024) --schemes keel model.out_norm_gain=false $(ARGS)
# What dropping the gains costs where Keel trains with them: Table 1's two sizes and 256 blocks (beside their keel rows)
NOGAIN := --schemes= --variant keel-nogain=model.scheme=keel,model.out_norm_gain=false
paper-nogain-d16: paper-data
	$(MAXLR) $(NOGAIN) --seeds $(TREND_SEEDS) $(SHALLOW) $(ARGS)
paper-nogain-d64: paper-data
	$(MAXLR) $(NOGAIN) --seeds $(TREND_SEEDS) $(DEEP) $(ARGS)
paper-nogain-d256: paper-data
	$(MAXLR) $(NOGAIN) --seeds $(WIDE_SEEDS) --depths 256 model.width=32 $(NARROW) $(ARGS)

# The claims about trained models (keel.experiments.trained, in keel paper-report): complete runs (linear warm-up, then
# cosine to 10% at the last step) of Keel and Pre-LN, each from its own init, with the in-loop generated tasks (400
# documents each), over TRAINED_SEEDS. LR sweeps at 16 x 64 and 64 x 32 (Table 2, loss against tasks; layer use: keel
# redundancy over their final checkpoints), 3-point LR sweeps at 16 and 256 blocks of width 32 (Table 3, with lr-d64).
# A run flagged by the stability monitor trains on to the end (its verdict is kept in stability.json). 2,000 steps:
# a pilot (Keel 16 x 64, LR 0.02) still fell 0.05 nat over its last 200 (docs/experiments.md); 256 blocks: 500 steps.
# The LRs: from about half of Pre-LN's loss-optimal LR on the linear ramp to above its max LR there.
TRAINED_STEPS ?= 2000
TRAINED_STEPS_D256 ?= 500
TRAINED_WARMUP ?= 200
TRAINED_SEEDS ?= 1,2,3
LRS_D16 ?= 0.01,0.02,0.04,0.08
LRS_D64 ?= 0.0125,0.025,0.05,0.1
TUNED_LRS ?= 0.01,0.02,0.04
TRAINED = $(KEEL) sweep --schemes keel,preln --seeds $(TRAINED_SEEDS) --out $(PAPER_OUT)/$(subst paper-,,$@) $(NARROW) \
	trainer.max_steps=$(TRAINED_STEPS) optim.warmup_steps=$(TRAINED_WARMUP) optim.schedule=cosine optim.min_lr_ratio=0.1 \
	trainer.val_every_n_steps=100 eval.every_n_steps=200 eval.limit=400 trainer.checkpoint_every_n_steps=500 \
	trainer.progress_bar=false callbacks.stability.stop_on_failure=false
TRAINED_GRIDS := lr-d16 lr-d64 tuned-depth-d16 tuned-depth-d256
.PHONY: paper-trained $(addprefix paper-,$(TRAINED_GRIDS)) paper-redundancy-lr-d16 paper-redundancy-lr-d64
paper-trained: $(addprefix paper-,$(TRAINED_GRIDS)) paper-redundancy-lr-d16 paper-redundancy-lr-d64
	$(KEEL) paper-report $(PAPER_OUT)
paper-lr-d16: paper-data
	$(TRAINED) --lrs $(LRS_D16) model.depth=16 model.width=64 $(ARGS)
paper-lr-d64: paper-data
	$(TRAINED) --lrs $(LRS_D64) model.depth=64 model.width=32 $(ARGS)
paper-tuned-depth-d16: paper-data
	$(TRAINED) --lrs $(TUNED_LRS) model.depth=16 model.width=32 $(ARGS)
paper-tuned-depth-d256: paper-data
	$(TRAINED) --lrs $(TUNED_LRS) model.depth=256 model.width=32 trainer.max_steps=$(TRAINED_STEPS_D256) \
		optim.warmup_steps=50 $(ARGS)
# after its grid (rerunning a finished grid skips its runs); the checkpoints are listed once the grid is done
paper-redundancy-lr-d16 paper-redundancy-lr-d64: paper-redundancy-%: paper-%
	$(KEEL) redundancy $(wildcard $(PAPER_OUT)/$*/*/checkpoints/last.ckpt) --out $(PAPER_OUT)/$*/redundancy

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

# A checkpoint as a Hugging Face model directory (docs/export.md): make export CKPT=... EXPORT_DIR=out/hf ARGS="--dtype bf16"
EXPORT_DIR ?= out/hf
export: install
	$(KEEL) export checkpoint=$(CKPT) --out $(EXPORT_DIR) $(ARGS)

tensorboard: install
	$(VENV)/bin/tensorboard --logdir runs

clean:
	rm -rf runs out
