"""The Keel language model and its five baselines: a plain decoder-only transformer whose
normalization / residual scheme is one config value (keel.config: the config, and each scheme's sublayers;
definitions: docs/schemes.md). Every sublayer (attention or FFN) computes

    out = [Norm_out]( alpha * skip + F( [Norm_in](x) ) )       skip = x, or Norm_in(x) for HybridNorm's FFN

The residual stream, every sum and every norm are kept in fp32 even under bf16 autocast: Keel's
branch is ~1/L of `alpha * x + F`, which bf16 (8 mantissa bits) cannot resolve at L >= 128. Only
the branches' matmuls run in bf16 (autocast, or the weights' own dtype under bf16-true / FSDP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from keel.config import ModelConfig
from keel.config.model import SublayerSpec, deepnorm_beta, needs_final_norm, sublayer_specs
from keel.ops.chunked_ce import ChunkKernel, chunk_loss, default_chunk, linear_cross_entropy
from keel.ops.rms_norm import rms_norm


@torch.no_grad()
def _deepnorm_init(model: KeelLM) -> None:
    """DeepNet's beta on both FFN matrices, the v and out projections; never q, k."""
    beta = deepnorm_beta(model.cfg)
    for block in model.blocks:
        attn = block.attn.branch
        attn.qkv.weight[(attn.n_heads + attn.kv_heads) * attn.head_dim :].mul_(beta)
        for linear in (attn.out, block.ffn.branch.up, block.ffn.branch.down):
            linear.weight.mul_(beta)


@torch.no_grad()
def _draw(model: KeelLM, embedding_std: float | None = None, fan_in: bool = False, truncated: bool = False) -> None:
    """Every Linear N(0, init_std^2) (fan_in: N(0, 1/fan_in); truncated: cut at 3 std), in module order, then the
    embedding N(0, embedding_std^2) (None: init_std)."""
    cfg = model.cfg
    for module in model.modules():
        if isinstance(module, nn.Linear):
            std = module.in_features**-0.5 if fan_in else cfg.init_std
            if truncated:
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            else:
                nn.init.normal_(module.weight, std=std)
    nn.init.normal_(model.embed.weight, std=cfg.init_std if embedding_std is None else embedding_std)


@torch.no_grad()
def _gpt2(model: KeelLM, truncated: bool = False) -> None:
    """_draw, then the residual branches' last matrices (attention out, FFN down) x 1/sqrt(L), L the number of
    sublayers (at model.branch_base_depth when set: its branch multiplier scales with depth instead): their sum over
    the depth keeps the stream's scale."""
    _draw(model, truncated=truncated)
    for block in model.blocks:
        for linear in (block.attn.branch.out, block.ffn.branch.down):
            linear.weight.mul_((2 * model.cfg.init_depth) ** -0.5)


@torch.no_grad()
def _xavier(model: KeelLM) -> None:
    """model.init=xavier (DeepNet's Fig. 2, gain 1): each of q, k, v, out, FFN up (gate and up apart) and down
    Xavier-normal with its own fans, std sqrt(2 / (fan_in + fan_out)); DeepNorm's beta then gives the gain beta.
    The embedding and the head: N(0, init_std^2)."""
    _draw(model)
    for block in model.blocks:
        attn, ffn = block.attn.branch, block.ffn.branch
        qkv_rows = [attn.n_heads * attn.head_dim, attn.kv_heads * attn.head_dim, attn.kv_heads * attn.head_dim]
        up_rows = [ffn.up.out_features // 2] * 2 if ffn.swiglu else [ffn.up.out_features]
        matrices = [*attn.qkv.weight.split(qkv_rows), attn.out.weight, *ffn.up.weight.split(up_rows), ffn.down.weight]
        for matrix in matrices:  # row slices are views: each is initialized in place
            nn.init.xavier_normal_(matrix)


# Every init kind (model.init), one entry each: how it draws the weights. Its description and the name the config
# accepts: keel.config.model.INITS (a test holds the two tables to one set of names).
INITS: dict[str, Callable[[KeelLM], None]] = {
    "normal": _draw,
    "gpt2": _gpt2,
    "megatron": lambda model: _gpt2(model, truncated=True),
    "xavier": _xavier,
    "mixln": lambda model: _draw(model, embedding_std=0.4**0.5),  # Mix-LN's code draws the embedding N(0, 2/5)
    "unit": lambda model: _draw(model, embedding_std=1.0, fan_in=True),
}
# Schemes whose init differs from the common one (model.init): adjustments run after it, keyed by keel.config.SCHEMES
# name. Kept here, not in the torch-free Scheme, because they are torch code that knows the modules' layout.
SCHEME_INITS: dict[str, Callable[[KeelLM], None]] = {"deepnorm": _deepnorm_init}


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm (gain, no bias; gain=False: none), always computed in fp32 so it stays exact under autocast."""

    def __init__(self, dim: int, eps: float, gain: bool = True) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=gain)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
        """RMSNorm(x), or RMSNorm(x + alpha * skip): a sublayer's sum and Norm_out in one step (keel.ops.rms_norm)."""
        return rms_norm(x, self.weight, self.eps, skip, alpha)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd/2); rotate the two halves of each head (GPT-NeoX layout)
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class KVCache:
    """Per-block keys and values seen so far, for incremental decoding."""

    def __init__(self, depth: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * depth
        self.values: list[torch.Tensor | None] = [None] * depth

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, block: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[block] is not None:
            k = torch.cat((self.keys[block], k), dim=2)
            v = torch.cat((self.values[block], v), dim=2)
        self.keys[block], self.values[block] = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv_norm: bool) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.scale = cfg.attention_scale  # None: SDPA's 1/sqrt(head_dim)
        self.qkv = nn.Linear(cfg.width, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.width, cfg.width, bias=False)
        # HybridNorm: q, k and v each RMS-normalized per head (one gain of size head_dim, shared by heads)
        self.q_norm = self.k_norm = self.v_norm = None
        if qkv_norm:
            self.q_norm, self.k_norm, self.v_norm = (RMSNorm(cfg.head_dim, cfg.norm_eps) for _ in range(3))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None, block: int, start: int
    ) -> torch.Tensor:
        B, T, _ = x.shape
        x = x.to(self.qkv.weight.dtype)  # no-op under autocast; bf16 when the weights are (bf16-true)
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k, v = (norm(t).type_as(t) for norm, t in ((self.q_norm, q), (self.k_norm, k), (self.v_norm, v)))
        cos, sin = (table[start : start + T] for table in rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(block, k, v)
        if start == 0:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.kv_heads != self.n_heads
            )
        else:  # new queries attend to every cached position and causally among themselves
            mask = torch.arange(start + T, device=x.device) <= torch.arange(start, start + T, device=x.device)[:, None]
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.kv_heads != self.n_heads
            )
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.ffn == "swiglu"
        self.up = nn.Linear(cfg.width, (2 if self.swiglu else 1) * cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x.to(self.up.weight.dtype))  # (B, T, hidden or 2 * hidden)
        if self.swiglu:
            gate, h = h.chunk(2, dim=-1)
            h = F.silu(gate) * h
        else:
            h = F.gelu(h)
        return self.down(h)


class Sublayer(nn.Module):
    """out = [Norm_out](alpha * skip + s * branch([Norm_in](x))), computed in fp32 around the branch; s = 1 but
    under model.branch_base_depth."""

    def __init__(self, spec: SublayerSpec, branch: nn.Module, cfg: ModelConfig) -> None:
        super().__init__()
        self.alpha = spec.alpha
        self.branch_scale = spec.branch_scale
        self.skip_from_norm_in = spec.skip_from_norm_in
        self.branch = branch
        self.norm_in = RMSNorm(cfg.width, cfg.norm_eps) if spec.norm_in else None
        self.norm_out = RMSNorm(cfg.width, cfg.norm_eps, cfg.out_norm_gain) if spec.norm_out else None

    def forward(self, x: torch.Tensor, **branch_kwargs) -> torch.Tensor:
        # x: (B, T, C) fp32 stream; the sum and the outer norm stay fp32 whatever dtype the branch uses
        h = self.norm_in(x) if self.norm_in is not None else x
        skip = h if self.skip_from_norm_in else x
        f = self.branch(h, **branch_kwargs).float()
        if self.branch_scale != 1:
            f = f * self.branch_scale
        if self.norm_out is not None:
            return self.norm_out(f, skip, self.alpha)  # Norm_out(F + alpha * skip)
        return torch.add(f, skip, alpha=self.alpha)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, attn_spec: SublayerSpec, ffn_spec: SublayerSpec) -> None:
        super().__init__()
        self.index = index
        self.attn = Sublayer(attn_spec, Attention(cfg, attn_spec.qkv_norm), cfg)
        self.ffn = Sublayer(ffn_spec, FeedForward(cfg), cfg)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None = None, start: int = 0
    ) -> torch.Tensor:
        x = self.attn(x, rope=rope, cache=cache, block=self.index, start=start)
        return self.ffn(x)


class KeelLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        specs = sublayer_specs(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i, *spec) for i, spec in enumerate(specs))
        self.final_norm = RMSNorm(cfg.width, cfg.norm_eps) if needs_final_norm(cfg) else None
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        # what computes each chunk of the loss head: eager here, compiled from outside (keel.parallel.compile_blocks)
        self.loss_chunk_kernel: ChunkKernel = chunk_loss
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The RoPE tables again (they are not in state_dict): for a model built on the meta device, once its
        storage exists (`Module.to_empty`) and its weights are loaded."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """model.init (docs/schemes.md#initialization): the norms' gains 1, the init kind's draw (INITS), then the
        scheme's changes (SCHEME_INITS) and muP's scaling."""
        cfg = self.cfg
        for module in self.modules():
            if isinstance(module, nn.RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)
        INITS[cfg.init_kind](self)
        if (scheme_init := SCHEME_INITS.get(cfg.scheme)) is not None:
            scheme_init(self)
        if cfg.parametrization == "mup":  # muP's fan-in rule: std ~ 1/sqrt(width), equal to sp's at the base width
            for matrix in self.hidden_matrices():
                matrix.mul_(cfg.mup_ratio**0.5)

    def sublayers(self) -> list[Sublayer]:
        """Every sublayer in forward order: block 0's attention, its FFN, block 1's attention, ..."""
        return [sub for block in self.blocks for sub in (block.attn, block.ffn)]

    def hidden_matrices(self) -> list[nn.Parameter]:
        """The weights muP calls hidden (both dimensions grow with the width): q, k, v, out, FFN up and down;
        not the embedding nor the head (keel.lit.make_optimizer scales their LR under model.parametrization=mup)."""
        return [
            linear.weight
            for block in self.blocks
            for linear in (block.attn.branch.qkv, block.attn.branch.out, block.ffn.branch.up, block.ffn.branch.down)
        ]

    def forward(
        self, idx: torch.Tensor, cache: KVCache | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """idx: (B, T) token ids -> logits (B, T, vocab), fp32 stream throughout. With targets (B, T): the mean
        cross-entropy of the logits against them instead (fp32 scalar), from the loss head (model.loss_chunk),
        which by default never materializes the full logits; the head module itself is then not called."""
        start = 0 if cache is None else cache.length
        if start + idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {start + idx.shape[1]} tokens exceeds model.seq_len={self.cfg.seq_len}")
        x = self.embed(idx).float()  # (B, T, C)
        rope = (self.rope_cos, self.rope_sin)
        for block in self.blocks:
            x = block(x, rope, cache, start)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.cfg.parametrization == "mup":  # muP's readout multiplier on the logits, as W_head (m x) = m W_head x
            x = x * self.cfg.mup_ratio
        if targets is None:
            return self.head(x.to(self.head.weight.dtype))
        chunk = default_chunk(x.device) if self.cfg.loss_chunk is None else self.cfg.loss_chunk
        return linear_cross_entropy(x.flatten(0, 1), self.head.weight, targets.flatten(), chunk, self.loss_chunk_kernel)

    def num_params(self, embeddings: bool = True) -> int:
        """All parameters, or all but the token embedding's (the head counted unless tied to it)."""
        counts = parameter_counts(self.cfg)
        return sum(counts.values()) - (0 if embeddings else counts["embedding"])


def block_layouts(cfg: ModelConfig) -> tuple[list, dict]:
    """Each block's sublayer layout, and one meta-device Block per distinct layout (nothing allocated)."""
    specs = sublayer_specs(cfg)
    with torch.device("meta"):
        return specs, {spec: Block(cfg, 0, *spec) for spec in set(specs)}


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """KeelLM(cfg)'s parameters by part, counted without building it (one meta-device block per distinct layout,
    so no depth allocates anything): embedding, blocks, final_norm, head (0 when tied to the embedding)."""
    specs, blocks = block_layouts(cfg)
    per_layout = {spec: sum(p.numel() for p in block.parameters()) for spec, block in blocks.items()}
    return {
        "embedding": cfg.vocab_size * cfg.width,
        "blocks": sum(per_layout[spec] for spec in specs),
        "final_norm": cfg.width if needs_final_norm(cfg) else 0,
        "head": 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.width,
    }


def next_token_loss(model: KeelLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1]; batch: (B, T + 1) token ids. Computed by
    the model's loss head (model.loss_chunk): by default without the full (B, T, vocab) logits."""
    return model(batch[:, :-1], targets=batch[:, 1:])
