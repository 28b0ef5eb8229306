"""The paper's grids as data, in one place: what each `make paper-<grid>` runs (`keel paper-run GRID`,
keel.experiments.paper_run) and which grids `make paper`, `make paper-linear` and `make paper-trained` run; the roles
`keel paper-report` reads them in are keel.experiments.roles. docs/grids.md's table of the grids is
`keel paper-run --table`.

A grid is a keel command and its arguments: "{NAME}" in one is a setting (SETTINGS: `make paper SEEDS=1,2`, or
`keel paper-run --set SEEDS=1,2`), {OUT} the grid's directory under PAPER_OUT; a Scaled part differs at paper scale
(PAPER_SCALE=1: --paper-scale). Rerunning a grid skips its finished runs. Torch-free: the Makefile lists it.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.experiments.records import REDUNDANCY_DIR

SETTINGS = {  # name -> default; the Makefile's variables of the same names override them
    "SEEDS": "1,2,3,4,5",  # Table 1's
    "TREND_SEEDS": "1,2,3",  # the trends', the hold map's, the Post-LN family's
    "WIDE_SEEDS": "1,2",  # the costliest points' (256 blocks; width 256)
    "TRAINED_SEEDS": "1,2,3",  # the trained models' (complete runs)
    "TRAINED_STEPS": "2000",  # why this long: docs/trained-models.md
    "TRAINED_STEPS_D256": "500",
    "TRAINED_WARMUP": "200",
    # the trained models' peak LRs: from about half Pre-LN's loss-optimal LR on the linear ramp to above its max LR
    "LRS_D16": "0.01,0.02,0.04,0.08",
    # at 64 x 32 one step lower than that rule gives: the first seed's optima lay at its bottom (docs/trained-models.md)
    "LRS_D64": "0.00625,0.0125,0.025,0.05",
    "TUNED_LRS": "0.01,0.02,0.04",
    # at 256 blocks (500 steps, seed 1) Keel at 0.01 stays at the unigram loss (6.72 at the end) and learns at 0.005
    # (5.50 by step 400); Pre-LN ends lower at 0.005 than at 0.01 (6.31 against 6.43): from 0.01 three octaves down
    "TUNED_LRS_D256": "0.00125,0.0025,0.005,0.01",
    # tuned-short-depth-d16: at 500 steps (a 50-step warm-up) 16 x 32 is no longer best near 0.02, as at 2,000: 0.02
    # gave a higher loss than 0.01 for each seed tried (docs/lr-transfer.md)
    "TUNED_SHORT_LRS": "0.0025,0.005,0.01,0.02",
    # Pre-LN under the 1/L branch rule at 64 blocks (depth-rule-d64): its 16-block optimum (about 0.017) and two
    # octaves below it, where plain Pre-LN's 64-block optimum lies (at most 0.00625)
    "DEPTH_RULE_LRS": "0.005,0.01,0.02,0.04",
    # LR transfer across width on complete runs (docs/lr-transfer.md): Keel at 8 blocks, widths 64 and 256, sp and mup
    "TRANSFER_SEEDS": "1,2,3",
    "TRANSFER_STEPS": "1000",
    # 5 LRs a factor 2 apart around the optimum: 16 x 64's complete runs were best at 0.01 (lr-d16); under sp the
    # width-256 optimum is expected about 4x lower (the hidden matrices' updates grow with width), hence its own set
    "TRANSFER_LRS": "0.0025,0.005,0.01,0.02,0.04",
    "TRANSFER_LRS_SP256": "0.000625,0.00125,0.0025,0.005,0.01",
}
# the make targets that run several grids, then the report
SETS = ("paper", "paper-linear", "paper-trained", "paper-transfer")
SBATCH = "{SBATCH}"  # at paper scale: one --sbatch=OPTION per #SBATCH option given
CHECKPOINTS = "{CHECKPOINTS}"  # the final checkpoints of the grid a redundancy grid is over, of runs with no rows yet


@dataclass(frozen=True)
class Scaled:
    """Arguments that differ at paper scale."""

    miniature: tuple[str, ...]
    paper: tuple[str, ...]


@dataclass(frozen=True)
class PaperGrid:
    command: str  # the keel command that runs it (keel.experiments.<command>): maxlr, sweep or redundancy
    args: tuple[str | Scaled, ...]
    point: tuple[int, int] | None  # (blocks, width) of its runs at miniature scale: the rows the report reads
    sets: tuple[str, ...] = ("paper",)  # of SETS
    only: tuple[tuple[tuple[str, ...], str], ...] = ()  # (schemes, a seeds setting): only these runs of the grid
    cluster: bool = False  # written as a SLURM array at paper scale: all `make paper PAPER_SCALE=1` runs
    over: str | None = None  # redundancy: the grid whose final checkpoints it measures


NARROW = ("model.n_heads=4", "model.seq_len=128", "trainer.micro_batch_size=8", "trainer.threads=1")


def size(blocks: int, width: int) -> tuple[str, ...]:
    return ("--depths", str(blocks), f"model.width={width}", *NARROW)


def slope(peak: str, steps: str, learn_by: str) -> tuple[str, ...]:
    """The paper's protocol: a linear warm-up from 0 to peak over steps, the held-out loss every 5 steps; a probe
    that has not learned by LR learn_by stops (none of these grids' runs learned later: docs/experiments.md)."""
    return ("--ramp", "linear", "--eval-every", "5", "--peak-lr", peak, "--steps", steps, "--learn-by-lr", learn_by)


def maxlr(point: tuple[int, int], *args: str | Scaled, **fields) -> PaperGrid:
    return PaperGrid("maxlr", ("--out", "{OUT}", *args), point, **fields)


SHALLOW = Scaled((), ("model=paper_d64", "trainer=gpu"))  # 16 x 64 is the miniature's own size
DEEP = Scaled(size(64, 32), ("--depths", "256", "model=paper_d64", "trainer=gpu"))
EMIT = Scaled((), ("--emit", "slurm", SBATCH))
SLOPE_1E4 = slope("0.4", "4000", "0.1")  # 1e-4 per step, LR resolution 5e-4: Table 1's
SLOPE_2E4, SLOPE_5E5 = slope("0.4", "2000", "0.1"), slope("0.4", "8000", "0.1")  # the hold map's other two
# 5e-5 per step ending at LR 0.1: at 256 x 32 Keel learns, then sits near the unigram loss, under the cap, to the end
# (docs/experiments.md); the rest of the ramp to 0.4 would only measure that plateau, at a high CPU cost. A probe
# that reaches 0.1 unbroken is a lower bound, the stricter margins judge it
SLOPE_5E5_TO_01 = slope("0.1", "2000", "0.1")
# 4x gentler: at 1e-4 per step HybridNorm passes its limit before it has learned, Post-LN at 64 x 32 never learns
SLOPE_2E5 = slope("0.1", "4000", "0.05")
# Keel at the family's slope, to the protocol's peak: its limit lies above the family's peak of 0.1
SLOPE_2E5_TO_04 = slope("0.4", "16000", "0.05")
PAIR = ("--schemes", "keel,preln")
TRIO = ("--schemes", "keel,preln,postln")
POSTLN = ("--schemes", "postln")
NOGAIN = ("--schemes=", "--variant", "keel-nogain=model.scheme=keel,model.out_norm_gain=false")
MUP = ("model.parametrization=mup", "model.mup_base_width=64")  # base width 64: the miniature's, there mup is sp
MUP_WIDTHS = (32, 64, 128, 256)
# Keel and Pre-LN over SEEDS, the Post-LN family over TREND_SEEDS (its limits are far below; HybridNorm, which does
# not learn at this slope, in linear-gentle-d16); at 64 x 32 Post-LN did not learn at this slope (docs/experiments.md):
# there the family runs at the gentle slope (linear-gentle-d64)
LINEAR_ONLY = ((("keel", "preln"), "SEEDS"), (("postln", "deepnorm", "mixln"), "TREND_SEEDS"))
FAMILY = ("--schemes", "postln,deepnorm,hybridnorm,mixln", "--seeds", "{TREND_SEEDS}")
LINEAR = ("paper", "paper-linear")
# The resolution of Table 1's linear probes: Keel and Pre-LN again under changes that should not matter, each a
# --variant row: two intra-op threads instead of one, and model.init_std one float32 ulp above 0.02
# (numpy.nextafter(float32(0.02), 1)). Two threads on a 2-core machine want it to themselves (no make -j2).
PERTURBATIONS = {"threads2": "trainer.threads=2", "ulp": "model.init_std=0.020000001415610313"}
RESOLUTION = tuple(
    word
    for scheme in ("keel", "preln")
    for name, change in PERTURBATIONS.items()
    for word in ("--variant", f"{scheme}-{name}=model.scheme={scheme},{change}")
)
# 1,024 blocks (L = 2,048) at a fixed LR that works at 64 blocks
DEEP1024 = (
    "--depths",
    "1024",
    "--lrs",
    "0.01",
    "--out",
    "{OUT}",
    "model.width=32",
    "model.n_heads=4",
    "model.seq_len=64",
    "trainer.micro_batch_size=8",
    "trainer.threads=1",
    "trainer.max_steps=200",
    "trainer.val_every_n_steps=25",
    "trainer.val_batches=8",
    "trainer.checkpoint_every_n_steps=50",
    "eval.enabled=false",
    "callbacks.grad_norms.every_n_steps=25",
    "callbacks.grad_norms.heatmap_every_n_steps=50",
    "callbacks.stability.stop_on_failure=false",
    "trainer.progress_bar=false",
)
# Complete runs (linear warm-up, then cosine to 10% at the last step) of Keel and Pre-LN, each from its own init,
# with the in-loop generated tasks (400 documents each); a run the stability monitor flags trains on to the end
TRAINED = (
    "--seeds",
    "{TRAINED_SEEDS}",
    "--out",
    "{OUT}",
    *NARROW,
    "trainer.max_steps={TRAINED_STEPS}",
    "optim.warmup_steps={TRAINED_WARMUP}",
    "optim.schedule=cosine",
    "optim.min_lr_ratio=0.1",
    "trainer.val_every_n_steps=100",
    "eval.every_n_steps=200",
    "eval.limit=400",
    "trainer.checkpoint_every_n_steps=500",
    "trainer.progress_bar=false",
    "callbacks.stability.stop_on_failure=false",
)


def trained(
    point: tuple[int, int],
    lrs: str,
    *args: str,
    schemes: str = "keel,preln",
    sets: tuple[str, ...] = ("paper-trained",),
) -> PaperGrid:
    blocks, width = point
    return PaperGrid(
        "sweep",
        ("--schemes", schemes, *TRAINED, "--lrs", lrs, f"model.depth={blocks}", f"model.width={width}", *args),
        point,
        sets,
    )


# Keel's complete runs at 8 blocks for the width-transfer grids: the trained models' schedule over TRANSFER_STEPS (a
# tenth of warm-up), the held-out loss every 100 steps, the in-loop tasks twice (mid-way and at the last step: at
# width 256 one evaluation costs about 45 CPU-s, as much as 75 training steps)
TRANSFER = (
    "--schemes",
    "keel",
    "--seeds",
    "{TRANSFER_SEEDS}",
    "--out",
    "{OUT}",
    *NARROW,
    "model.depth=8",
    "trainer.max_steps={TRANSFER_STEPS}",
    "optim.warmup_steps=100",
    "optim.schedule=cosine",
    "optim.min_lr_ratio=0.1",
    "trainer.val_every_n_steps=100",
    "eval.every_n_steps=500",
    "eval.limit=400",
    "trainer.checkpoint_every_n_steps=250",
    "trainer.progress_bar=false",
    "callbacks.stability.stop_on_failure=false",
)
TRANSFER_WIDTHS = (64, 256)
DEPTH_RULE = ("model.branch_base_depth=16",)  # Pre-LN's 1/L branch rule from tuned-depth-d16's depth
# the 256-block sweeps' length (4x the blocks for a quarter of the trained models' steps), and 16 blocks' at it
SHORT_RUN = ("trainer.max_steps={TRAINED_STEPS_D256}", "optim.warmup_steps=50")


def transfer(width: int, parametrization: str) -> PaperGrid:
    lrs = "{TRANSFER_LRS_SP256}" if (width, parametrization) == (256, "sp") else "{TRANSFER_LRS}"
    mup = MUP if parametrization == "mup" else ()
    return PaperGrid("sweep", (*TRANSFER, "--lrs", lrs, f"model.width={width}", *mup), (8, width), ("paper-transfer",))


def redundancy(grid: str) -> PaperGrid:
    """keel redundancy over the final checkpoints of a grid's runs that have no rows yet, into <grid>/redundancy/
    beside the rows already there (those of committed records whose checkpoints are gone too)."""
    return PaperGrid(
        "redundancy",
        (CHECKPOINTS, "--append", "--out", f"{{PAPER_OUT}}/{grid}/{REDUNDANCY_DIR}"),
        None,
        ("paper-trained",),
        over=grid,
    )


GRIDS = {
    # Table 1 on the paper's protocol (the primary one): every scheme at 16 blocks x 64 and at 64 x 32
    "linear-d16": maxlr((16, 64), "--seeds", "{SEEDS}", *SLOPE_1E4, only=LINEAR_ONLY, sets=LINEAR),
    "linear-d64": maxlr((64, 32), *PAIR, "--seeds", "{SEEDS}", *SLOPE_1E4, *size(64, 32), sets=LINEAR),
    "linear-gentle-d16": maxlr((16, 64), *FAMILY, *SLOPE_2E5, sets=LINEAR),
    "linear-gentle-d64": maxlr((64, 32), *FAMILY, *SLOPE_2E5, *size(64, 32), sets=LINEAR),
    # Keel at the family's slope: the family against Keel on one protocol, at Table 1's two sizes and over depth at
    # width 32 (Post-LN there: linear-gentle-depth-d16, linear-gentle-d64)
    "linear-gentle-keel-d16": maxlr((16, 64), "--schemes", "keel", "--seeds", "{TREND_SEEDS}", *SLOPE_2E5_TO_04),
    "linear-gentle-keel-d64": maxlr(
        (64, 32), "--schemes", "keel", "--seeds", "{TREND_SEEDS}", *SLOPE_2E5_TO_04, *size(64, 32)
    ),
    "linear-gentle-keel-depth-d16": maxlr(
        (16, 32), "--schemes", "keel", "--seeds", "{TREND_SEEDS}", *SLOPE_2E5_TO_04, *size(16, 32)
    ),
    # the hold map: the same probes at twice and half the slope, Keel and Pre-LN
    "hold-d16-fast": maxlr((16, 64), *PAIR, "--seeds", "{TREND_SEEDS}", *SLOPE_2E4, sets=LINEAR),
    "hold-d16-slow": maxlr((16, 64), *PAIR, "--seeds", "{TREND_SEEDS}", *SLOPE_5E5, sets=LINEAR),
    "hold-d64-fast": maxlr((64, 32), *PAIR, "--seeds", "{TREND_SEEDS}", *SLOPE_2E4, *size(64, 32), sets=LINEAR),
    "hold-d64-slow": maxlr((64, 32), *PAIR, "--seeds", "{TREND_SEEDS}", *SLOPE_5E5, *size(64, 32), sets=LINEAR),
    # Table 1's Keel and Pre-LN probes under the PERTURBATIONS, TREND_SEEDS: the spread is the resolution
    "resolution-d16": maxlr((16, 64), "--schemes=", *RESOLUTION, "--seeds", "{TREND_SEEDS}", *SLOPE_1E4, sets=LINEAR),
    "resolution-d64": maxlr(
        (64, 32), "--schemes=", *RESOLUTION, "--seeds", "{TREND_SEEDS}", *SLOPE_1E4, *size(64, 32), sets=LINEAR
    ),
    # the trends on the paper's protocol; Post-LN's depth row at the gentle slope, as at 64 x 32
    "linear-depth-d16": maxlr((16, 32), *PAIR, "--seeds", "{TREND_SEEDS}", *SLOPE_1E4, *size(16, 32), sets=LINEAR),
    "linear-depth-d256": maxlr((256, 32), *PAIR, "--seeds", "{WIDE_SEEDS}", *SLOPE_1E4, *size(256, 32), sets=LINEAR),
    "linear-gentle-depth-d16": maxlr(
        (16, 32), *POSTLN, "--seeds", "{TREND_SEEDS}", *SLOPE_2E5, *size(16, 32), sets=LINEAR
    ),
    "linear-gentle-depth-d256": maxlr(
        (256, 32), *POSTLN, "--seeds", "{WIDE_SEEDS}", *SLOPE_2E5, *size(256, 32), sets=LINEAR
    ),
    # the depth trend again at half the slope, where 1e-4 per step outruns learning (Pre-LN at 64 x 32, both at 256)
    "linear-slow-depth-d16": maxlr((16, 32), *PAIR, "--seeds", "{TREND_SEEDS}", *SLOPE_5E5, *size(16, 32), sets=LINEAR),
    "linear-slow-depth-d256": maxlr(
        (256, 32), *PAIR, "--seeds", "{WIDE_SEEDS}", *SLOPE_5E5_TO_01, *size(256, 32), sets=LINEAR
    ),
    "linear-width-w128": maxlr((16, 128), *PAIR, "--seeds", "{TREND_SEEDS}", *SLOPE_1E4, *size(16, 128), sets=LINEAR),
    "linear-width-w256": maxlr((16, 256), *PAIR, "--seeds", "{WIDE_SEEDS}", *SLOPE_1E4, *size(16, 256), sets=LINEAR),
    # Table 1 on the geometric ramp (the second protocol): every scheme at 16 x 64, the four the paper runs deep at
    # 64 x 32; at paper scale SLURM arrays (gather each with `keel maxlr collect DIR`)
    "table1-d16": maxlr((16, 64), "--seeds", "{SEEDS}", EMIT, SHALLOW, cluster=True),
    "table1-d64": maxlr(
        (64, 32), "--schemes", "keel,preln,postln,deepnorm", "--seeds", "{SEEDS}", EMIT, DEEP, cluster=True
    ),
    # trends: depth at width 32 (64 blocks: table1-d64), width at 16 blocks (64: table1-d16, 32: depth-d16), 8x the
    # tokens per step at 16 x 64
    "depth-d16": maxlr((16, 32), *TRIO, "--seeds", "{TREND_SEEDS}", *size(16, 32)),
    "depth-d256": maxlr((256, 32), *TRIO, "--seeds", "{WIDE_SEEDS}", *size(256, 32)),
    "width-w128": maxlr((16, 128), *PAIR, "--seeds", "{TREND_SEEDS}", *size(16, 128)),
    "width-w256": maxlr((16, 256), *PAIR, "--seeds", "{WIDE_SEEDS}", *size(16, 256)),
    "batch-8x": maxlr((16, 64), *PAIR, "--seeds", "{TREND_SEEDS}", *size(16, 64), "trainer.micro_batch_size=64"),
    # the criterion's check: the ramp twice as slow (a real LR limit stays at its LR, an artefact moves with the step)
    "ramp-2x": maxlr(
        (16, 64),
        *PAIR,
        "--seeds",
        "1,2",
        "--steps",
        "1120",
        "--eval-every",
        "40",
        "callbacks.stability.spike_patience=80",
    ),
    # HybridNorm with the shared init and with its authors' (Megatron-scaled output projections), on a ramp from 1e-4
    "hybridnorm": maxlr(
        (16, 64),
        "--schemes",
        "hybridnorm",
        "--variant",
        "hybridnorm-megatron=model.scheme=hybridnorm,model.init=megatron",
        "--seeds",
        "{TREND_SEEDS}",
        "--start-lr",
        "1e-4",
        "--steps",
        "720",
        "model.init=normal",
    ),
    # past 1000 layers: three schemes, then Keel without the outer norms' per-channel gains
    "deep1024": PaperGrid("sweep", (*DEEP1024, "--schemes", "keel,preln,postln"), (1024, 32)),
    "deep1024-nogain": PaperGrid("sweep", (*DEEP1024, "--schemes", "keel", "model.out_norm_gain=false"), (1024, 32)),
    # what dropping the gains costs where Keel trains with them: Table 1's two sizes and 256 blocks
    "nogain-d16": maxlr((16, 64), *NOGAIN, "--seeds", "{TREND_SEEDS}", SHALLOW),
    "nogain-d64": maxlr((64, 32), *NOGAIN, "--seeds", "{TREND_SEEDS}", DEEP),
    "nogain-d256": maxlr((256, 32), *NOGAIN, "--seeds", "{WIDE_SEEDS}", *size(256, 32)),
    # LR transfer across width under muP (docs/model.md#mup-modelparametrization): the width trend's grids again
    **{
        f"mup-width-w{width}": maxlr(
            (16, width), *PAIR, "--seeds", "{WIDE_SEEDS}" if width == 256 else "{TREND_SEEDS}", *size(16, width), *MUP
        )
        for width in MUP_WIDTHS
    },
    # the trained models: LR sweeps at 16 x 64 and 64 x 32, 3- and 4-LR sweeps at 16 and 256 blocks of width 32, the
    # layer use of the LR sweeps' final checkpoints (after their grid)
    "lr-d16": trained((16, 64), "{LRS_D16}"),
    "lr-d64": trained((64, 32), "{LRS_D64}"),
    "tuned-depth-d16": trained((16, 32), "{TUNED_LRS}"),
    "tuned-depth-d256": trained((256, 32), "{TUNED_LRS_D256}", *SHORT_RUN),
    "redundancy-lr-d16": redundancy("lr-d16"),
    "redundancy-lr-d64": redundancy("lr-d64"),
    # what carries across width on complete runs, sp against mup (base width 64, where the two compute alike)
    **{
        f"transfer-w{width}-{parametrization}": transfer(width, parametrization)
        for width in TRANSFER_WIDTHS
        for parametrization in ("sp", "mup")
    },
    # Pre-LN with CompleteP's 1/L branch rule from 16 blocks (docs/model.md, "Depth-scaled branches"): at 16 blocks
    # it is tuned-depth-d16's Pre-LN, bit for bit; does its optimum then hold at 64 and 256 blocks? At 256 blocks (500
    # steps) the optimum to hold is 16 blocks' over 500 steps (tuned-short-depth-d16's Pre-LN, about 0.005): its LRs
    "depth-rule-d64": trained((64, 32), "{DEPTH_RULE_LRS}", *DEPTH_RULE, schemes="preln", sets=("paper-transfer",)),
    "depth-rule-d256": trained(
        (256, 32),
        "{TUNED_SHORT_LRS}",
        *DEPTH_RULE,
        *SHORT_RUN,
        schemes="preln",
        sets=("paper-transfer",),
    ),
    # tuned-depth-d256's length at 16 blocks: the optimum against depth at equal steps (it moves with the run's length)
    "tuned-short-depth-d16": trained(
        (16, 32),
        "{TUNED_SHORT_LRS}",
        *SHORT_RUN,
        sets=("paper-transfer",),
    ),
}
