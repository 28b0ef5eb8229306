"""The model's config (`model.*`) and its normalization / residual schemes (`model.scheme`), in plain Python: each
scheme's sublayers, final norm and default init, and each init kind (INITS) - the facts model.* is checked against
before torch is imported (a config error costs no torch start-up), and that keel.model builds from (the torch side
of an init: keel.model.INITS, SCHEME_INITS; definitions: docs/schemes.md).

Every sublayer (attention or FFN) computes

    out = [Norm_out]( alpha * skip + F( [Norm_in](x) ) )       skip = x, or Norm_in(x) for HybridNorm's FFN

and a scheme is only the choice of (Norm_in?, Norm_out?, alpha, skip source) per sublayer: one `SCHEMES`
entry each (the table: docs/schemes.md, "One form for every sublayer").
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from keel.errors import require

FFN_KINDS = ("gelu", "swiglu")
KEEL_FIRST_BLOCK = ("v1", "v2")
# model.parametrization: sp (standard) | mup (muP for AdamW, Tensor Programs V; docs/model.md#mup-modelparametrization)
PARAMETRIZATIONS = ("sp", "mup")
# Every init kind (model.init; `auto` = the scheme's own, Scheme.init): what it draws, in words, for the start-up
# summary. keel.model.INITS draws each, under the same name (a test holds the two tables to one set of names).
INITS: dict[str, Callable[[ModelConfig], str]] = {
    "normal": lambda cfg: f"every matrix and the embedding N(0, {cfg.init_std:g}^2)",
    "gpt2": lambda cfg: f"N(0, {cfg.init_std:g}^2), attention out and FFN down x 1/sqrt(2 x {cfg.init_depth})",
    "megatron": lambda cfg: (
        f"N(0, {cfg.init_std:g}^2) cut at 3 std, attention out and FFN down x 1/sqrt(2 x {cfg.init_depth})"
    ),
    "xavier": lambda cfg: f"the blocks' matrices Xavier-normal, embedding and head N(0, {cfg.init_std:g}^2)",
    "mixln": lambda cfg: f"every matrix N(0, {cfg.init_std:g}^2), the embedding N(0, 2/5)",
    "unit": lambda cfg: "Linear N(0, 1/fan_in), embedding N(0, 1)",
}
# inits whose std already depends on the width: muP's fan-in rule would scale them twice
WIDTH_DEPENDENT_INITS = ("xavier", "unit")


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    depth: int = 16  # blocks, each an attention and an FFN sublayer
    width: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None  # GQA; None = n_heads
    ffn: str = "gelu"  # gelu (fc, GELU, proj) | swiglu
    ffn_mult: float = 4.0  # FFN hidden size = ffn_mult * width
    seq_len: int = 256
    rope_theta: float = 1e4
    tie_embeddings: bool = False
    # auto: the scheme's own literature's recipe (Scheme.init), or one of INITS (above: what each draws).
    # DeepNorm's beta applies on top of any of them.
    init: str = "auto"
    init_std: float = 0.02
    norm_eps: float = 1e-5
    scheme: str = "keel"
    keel_alpha: float | None = None  # None = L, the number of sublayers
    keel_first_block: str = "v1"  # v1: first attention and FFN plain Pre-LN; v2: paper's revision
    keel_inner_norm: bool = (
        True  # false: the ablation without Keel's inner norm (blocks after the first: Post-LN + alpha)
    )
    # false: every Norm_out without its learnable per-channel gain. With alpha = L a sublayer is nearly
    # x -> gain * x / rms(x), so the gains multiply coordinate-wise over all L sublayers (docs/schemes.md)
    out_norm_gain: bool = True
    deepnorm_alpha: float | None = None  # None = (2N)^(1/4)
    deepnorm_beta: float | None = None  # None = (8N)^(-1/4)
    mixln_post_fraction: float = 0.25
    postln_final_norm: bool = False
    # tokens per chunk of the loss head (LM head + cross-entropy fused, keel.ops.chunked_ce): 0 = plain head over
    # full logits; null = the device's default. How the loss is computed, not what: checkpoints resume across it
    loss_chunk: int | None = None
    # sp: standard. mup: muP for AdamW (docs/model.md#mup-modelparametrization), equal to sp at width
    # mup_base_width: the hidden matrices' init std x sqrt(base/width) and LR x base/width, the logits x base/width,
    # attention q.k x sqrt(base_hd)/hd
    parametrization: str = "sp"
    mup_base_width: int = 128
    # the base model's head_dim, where attention's 1/head_dim rule starts from; null = mup_base_width / n_heads (the
    # heads held fixed across widths). Set it when the tuned model has another head count (a 4-head miniature: 16)
    mup_base_head_dim: int | None = None
    # Pre-LN only: null, or a depth D at which the residual branches are as usual; at depth L each branch enters the
    # stream x D / L (x + (D/L) F(Norm(x)): the 1/L branch rule of CompleteP, depth-muP with exponent 1) and the
    # depth-scaled inits (gpt2, megatron) draw as at depth D, so a model of any depth starts and steps like the
    # depth-D one (docs/model.md#depth-scaled-branches-modelbranch_base_depth)
    branch_base_depth: int | None = None

    def __post_init__(self) -> None:
        scheme_of(self)  # refuses a scheme outside SCHEMES, naming the allowed ones
        for key, noun, allowed in (
            ("ffn", "FFN", FFN_KINDS),
            ("init", "init", ("auto", *INITS)),
            ("keel_first_block", "rule", KEEL_FIRST_BLOCK),
            ("parametrization", "parametrization", PARAMETRIZATIONS),
        ):
            value = getattr(self, key)
            require(value in allowed, f"model.{key}", f"unknown {noun} {value!r}; allowed: {', '.join(allowed)}")
        require(
            self.keel_inner_norm or self.scheme == "keel",
            "model.keel_inner_norm",
            f"applies to scheme keel only (scheme is {self.scheme!r}); leave it true",
        )
        require(
            self.out_norm_gain or any(spec.norm_out for block in sublayer_specs(self) for spec in block),
            "model.out_norm_gain",
            f"scheme {self.scheme!r} has no Norm_out at this depth; leave it true",
        )
        require(
            self.parametrization == "sp" or self.init_kind not in WIDTH_DEPENDENT_INITS,
            "model.init",
            f"init {self.init_kind!r} already scales with the width, which model.parametrization=mup does too; "
            f"use one of {', '.join(k for k in INITS if k not in WIDTH_DEPENDENT_INITS)}",
        )
        for key in ("vocab_size", "depth", "width", "n_heads", "seq_len", "mup_base_width"):
            require(getattr(self, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(
            self.branch_base_depth is None or self.branch_base_depth >= 1,
            "model.branch_base_depth",
            f"must be null (branches unscaled) or >= 1, got {self.branch_base_depth}",
        )
        require(
            self.branch_base_depth is None or self.scheme == "preln",
            "model.branch_base_depth",
            f"scales Pre-LN's residual branches (scheme preln); scheme {self.scheme!r} sets its own residual scale: "
            "leave it null",
        )
        require(
            self.mup_base_head_dim is None or self.mup_base_head_dim >= 1,
            "model.mup_base_head_dim",
            f"must be null (= mup_base_width / n_heads) or >= 1, got {self.mup_base_head_dim}",
        )
        require(
            self.width % self.n_heads == 0,
            "model.width",
            f"width {self.width} must be divisible by model.n_heads={self.n_heads}",
        )
        require(self.head_dim % 2 == 0, "model.width", f"head dim width/n_heads = {self.head_dim} must be even (RoPE)")
        require(
            1 <= self.kv_heads <= self.n_heads and self.n_heads % self.kv_heads == 0,
            "model.n_kv_heads",
            f"must be null (= n_heads) or a divisor of model.n_heads={self.n_heads}, got {self.n_kv_heads}",
        )
        for key in ("ffn_mult", "init_std", "norm_eps", "rope_theta"):
            require(getattr(self, key) > 0, f"model.{key}", f"must be > 0, got {getattr(self, key)}")
        require(
            self.loss_chunk is None or self.loss_chunk >= 0,
            "model.loss_chunk",
            f"must be >= 0 (tokens per chunk; 0 = plain head) or null (device default), got {self.loss_chunk}",
        )
        require(0.0 <= self.mixln_post_fraction <= 1.0, "model.mixln_post_fraction", "must be in [0, 1]")
        for key in ("keel_alpha", "deepnorm_alpha", "deepnorm_beta"):
            value = getattr(self, key)
            require(value is None or value > 0, f"model.{key}", f"must be > 0 or null (scheme default), got {value}")

    @property
    def init_kind(self) -> str:
        """The init in force: model.init, or the scheme's own recipe when it is `auto`."""
        return scheme_of(self).init if self.init == "auto" else self.init

    @property
    def mup_ratio(self) -> float:
        """mup_base_width / width under mup (the hidden matrices' LR multiplier, the logits' multiplier), 1 under sp."""
        return self.mup_base_width / self.width if self.parametrization == "mup" else 1.0

    @property
    def attention_scale(self) -> float | None:
        """q.k's scale: None = 1/sqrt(head_dim) (sp); under mup 1/head_dim times sqrt(the base model's head_dim),
        so that it is sp's at the base."""
        if self.parametrization == "sp":
            return None
        base = self.mup_base_head_dim or self.mup_base_width / self.n_heads
        return base**0.5 / self.head_dim

    @property
    def branch_scale(self) -> float:
        """What each residual branch is multiplied by: branch_base_depth / depth, or 1."""
        return 1.0 if self.branch_base_depth is None else self.branch_base_depth / self.depth

    @property
    def init_depth(self) -> int:
        """The depth the depth-scaled inits (gpt2, megatron) are drawn for: branch_base_depth, or the depth."""
        return self.branch_base_depth or self.depth

    @property
    def n_sublayers(self) -> int:
        """The paper's L: an attention and an FFN sublayer per block."""
        return 2 * self.depth

    @property
    def head_dim(self) -> int:
        return self.width // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden(self) -> int:
        return int(self.ffn_mult * self.width)


def init_description(cfg: ModelConfig) -> str:
    """The init in force in words, e.g. `gpt2 (preln's own recipe, model.init=auto): N(0, 0.02^2), attention out
    and FFN down x 1/sqrt(2 x 16)` (the start-up summary)."""
    kind = cfg.init_kind
    what = INITS[kind](cfg)
    if cfg.scheme == "deepnorm":
        what += f"; DeepNorm's beta {deepnorm_beta(cfg):.4g} on v, out and both FFN matrices"
    if cfg.parametrization == "mup":
        ratio = cfg.mup_ratio
        what += (
            f"; mup (base width {cfg.mup_base_width}): hidden matrices' std x {ratio**0.5:.4g} and LR x "
            f"{ratio:.4g}, logits x {ratio:.4g}, attention scale {cfg.attention_scale:.4g}"
        )
    origin = f"{cfg.scheme}'s own recipe, model.init=auto" if cfg.init == "auto" else f"model.init={kind}"
    return f"{kind} ({origin}): {what}"


@dataclass(frozen=True)
class SublayerSpec:
    """How one sublayer combines its skip and branch."""

    norm_in: bool
    norm_out: bool
    alpha: float = 1.0
    skip_from_norm_in: bool = False  # HybridNorm FFN: u + FFN(u), u = Norm(x)
    qkv_norm: bool = False  # HybridNorm attention: per-head RMSNorm of q, k, v
    branch_scale: float = 1.0  # the branch's multiplier (model.branch_base_depth)

    def formula(self) -> str:
        """The sublayer as an equation in its input x, e.g. `Norm_out(32 x + F(Norm_in(x)))` (docs/schemes.md)."""
        h = "Norm_in(x)" if self.norm_in else "x"
        skip = h if self.skip_from_norm_in else "x"
        branch = f"{'' if self.branch_scale == 1 else f'{self.branch_scale:.3g} '}{'F_qkvn' if self.qkv_norm else 'F'}"
        total = f"{'' if self.alpha == 1 else f'{self.alpha:.3g} '}{skip} + {branch}({h})"
        return f"Norm_out({total})" if self.norm_out else total


BlockSpecs = list[tuple[SublayerSpec, SublayerSpec]]  # (attention, FFN) per block
PRE = SublayerSpec(norm_in=True, norm_out=False)
POST = SublayerSpec(norm_in=False, norm_out=True)


def _keel(cfg: ModelConfig) -> BlockSpecs:
    keel = SublayerSpec(norm_in=cfg.keel_inner_norm, norm_out=True, alpha=cfg.keel_alpha or float(cfg.n_sublayers))
    first = (PRE, PRE) if cfg.keel_first_block == "v1" else (PRE, SublayerSpec(norm_in=True, norm_out=True))
    return [first] + [(keel, keel)] * (cfg.depth - 1)


def deepnorm_beta(cfg: ModelConfig) -> float:
    """DeepNet's init gain for v, out and both FFN matrices (keel.model.SCHEME_INITS)."""
    return cfg.deepnorm_beta or (8 * cfg.depth) ** -0.25


def _preln(cfg: ModelConfig) -> BlockSpecs:
    pre = replace(PRE, branch_scale=cfg.branch_scale)
    return [(pre, pre)] * cfg.depth


def _deepnorm(cfg: ModelConfig) -> BlockSpecs:
    deep = SublayerSpec(norm_in=False, norm_out=True, alpha=cfg.deepnorm_alpha or cfg.n_sublayers**0.25)
    return [(deep, deep)] * cfg.depth


def _mixln(cfg: ModelConfig) -> BlockSpecs:
    n_post = math.floor(round(cfg.mixln_post_fraction * cfg.depth, 6))  # round: 0.29 * 100 must give 29, not 28
    return [(POST, POST)] * n_post + [(PRE, PRE)] * (cfg.depth - n_post)


HYBRID_ATTN = SublayerSpec(norm_in=False, norm_out=False, qkv_norm=True)
HYBRID_FFN = SublayerSpec(norm_in=True, norm_out=False, skip_from_norm_in=True)


def _hybridnorm(cfg: ModelConfig) -> BlockSpecs:
    return [(HYBRID_ATTN, HYBRID_FFN)] * cfg.depth


def _hybridnorm_star(cfg: ModelConfig) -> BlockSpecs:
    return [(SublayerSpec(norm_in=True, norm_out=False, qkv_norm=True), PRE)] + _hybridnorm(cfg)[1:]


def _unless_last_normalized(cfg: ModelConfig) -> bool:
    return not sublayer_specs(cfg)[-1][1].norm_out


@dataclass(frozen=True)
class Scheme:
    """Everything scheme-specific but its init's torch code (keel.model.SCHEME_INITS): adding a scheme is one entry
    in SCHEMES (and its section in docs/schemes.md)."""

    blocks: Callable[[ModelConfig], BlockSpecs]  # (attention, FFN) spec of every block
    # the init its own literature trains it with (model.init=auto; one of INITS; sources in docs/schemes.md)
    init: str = "normal"
    final_norm: Callable[[ModelConfig], bool] = lambda cfg: True  # a norm before the head
    # the block that gradient ratios call "bottom" (keel.gradflow): the first that is like the others
    bottom_block: Callable[[ModelConfig], int] = lambda cfg: 0
    # the residual scale an --alphas axis sweeps: the ModelConfig field that sets it, and its value
    alpha_field: str | None = None
    alpha: Callable[[ModelConfig], float] | None = None
    variant_of: str | None = None  # a variant of another scheme, not one of Keel's and the paper's five baselines


# Every scheme, one entry each (docs/schemes.md): model.scheme's allowed values, in this order everywhere.
SCHEMES = {
    # block 0 has alpha = 1, unlike the rest: not "bottom"
    "keel": Scheme(
        _keel,
        final_norm=_unless_last_normalized,
        bottom_block=lambda cfg: min(1, cfg.depth - 1),
        alpha_field="keel_alpha",
        alpha=lambda cfg: cfg.keel_alpha or float(cfg.n_sublayers),
    ),
    "preln": Scheme(_preln, init="gpt2"),
    "postln": Scheme(lambda cfg: [(POST, POST)] * cfg.depth, final_norm=lambda cfg: cfg.postln_final_norm),
    "deepnorm": Scheme(_deepnorm, final_norm=_unless_last_normalized, init="xavier"),
    "hybridnorm": Scheme(_hybridnorm, init="megatron"),
    "hybridnorm_star": Scheme(_hybridnorm_star, init="megatron", variant_of="hybridnorm"),
    "mixln": Scheme(_mixln, init="mixln"),
}
PAPER_SCHEMES = tuple(name for name, scheme in SCHEMES.items() if scheme.variant_of is None)


def scheme_named(name: str) -> Scheme:
    require(name in SCHEMES, "model.scheme", f"unknown scheme {name!r}; allowed: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def scheme_of(cfg: ModelConfig) -> Scheme:
    return scheme_named(cfg.scheme)


def formulas(cfg: ModelConfig) -> list[tuple[str, int]]:
    """The scheme's distinct sublayer formulas in order of first use, each with how many sublayers use it."""
    counts = Counter(spec.formula() for block in sublayer_specs(cfg) for spec in block)
    return list(counts.items())


def sublayer_specs(cfg: ModelConfig) -> BlockSpecs:
    """(attention, FFN) spec for every block, per docs/schemes.md."""
    return scheme_of(cfg).blocks(cfg)


def needs_final_norm(cfg: ModelConfig) -> bool:
    return scheme_of(cfg).final_norm(cfg)
