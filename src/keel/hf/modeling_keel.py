"""A model trained with Keel (https://arxiv.org/abs/2601.19895 and its baselines) as a transformers causal LM, for
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` on a directory `keel export` wrote.
Self-contained: torch and transformers only; tests hold it to keel.model.KeelLM (logits, loss, greedy decoding).

Every sublayer (attention or FFN) is

    out = [Norm_out]( alpha * skip + F( [Norm_in](x) ) )       skip = x, or Norm_in(x) (skip_from_norm_in)

with its choices read from config.sublayers. The residual stream, sums and norms (gains included) are fp32 in any
weight dtype: Keel's branch is ~1/L of alpha * x + F, which bf16 cannot resolve. Around the blocks it works as
transformers' Llama does (causal mask, attn_implementation, capture_outputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_keel import KeelConfig


class KeelRMSNorm(nn.Module):
    """RMSNorm(x + alpha * skip) * gain in fp32 (gain=False: no gain, as Norm_out with out_norm_gain=false)."""

    def __init__(self, dim: int, eps: float, gain: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
        x = x.float()
        if skip is not None:
            x = torch.add(x, skip, alpha=alpha)
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x, x.shape[-1:], weight, self.eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (B, 1, T, hd/2); the two halves of each head rotated (GPT-NeoX layout)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # (B, Hkv, T, hd) -> (B, Hkv * n_rep, T, hd): each key/value head shared by n_rep query heads
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention as explicit matmuls, returning its weights (B, H, T, keys) too: attn_implementation="eager", for
    output_attentions. attention_mask is additive (transformers' eager mask)."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class KeelAttention(nn.Module):
    def __init__(self, config: KeelConfig, layer_idx: int, qkv_norm: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = True
        self.n_heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.num_key_value_groups = self.n_heads // self.kv_heads
        self.scaling = self.head_dim**-0.5 if config.attention_scale is None else config.attention_scale
        self.qkv = nn.Linear(config.hidden_size, (self.n_heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        # HybridNorm: q, k and v each RMS-normalized per head (one gain of size head_dim, shared by heads)
        self.q_norm = self.k_norm = self.v_norm = None
        if qkv_norm:
            self.q_norm, self.k_norm, self.v_norm = (KeelRMSNorm(self.head_dim, config.rms_norm_eps) for _ in range(3))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Cache | None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The branch's output (B, T, C) and, under eager attention, the attention weights (B, H, T, keys)."""
        B, T, _ = x.shape
        x = x.to(self.qkv.weight.dtype)
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k, v = (norm(t).type_as(t) for norm, t in ((self.q_norm, q), (self.k_norm, k), (self.v_norm, v)))
        q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        y, weights = attention(self, q, k, v, mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.out(y.reshape(B, T, -1)), weights


class KeelFeedForward(nn.Module):
    def __init__(self, config: KeelConfig) -> None:
        super().__init__()
        self.swiglu = config.hidden_act == "swiglu"
        self.up = nn.Linear(config.hidden_size, (2 if self.swiglu else 1) * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x.to(self.up.weight.dtype))  # (B, T, hidden or 2 * hidden)
        if self.swiglu:
            gate, h = h.chunk(2, dim=-1)
            h = F.silu(gate) * h
        else:
            h = F.gelu(h)
        return self.down(h)


class KeelSublayer(nn.Module):
    """out = [Norm_out](alpha * skip + branch_scale * branch([Norm_in](x))), fp32 around the branch."""

    def __init__(self, config: KeelConfig, spec: dict, branch: nn.Module) -> None:
        super().__init__()
        self.alpha = float(spec["alpha"])
        self.branch_scale = float(spec.get("branch_scale", 1.0))  # absent from exports made before it existed
        self.skip_from_norm_in = spec["skip_from_norm_in"]
        self.branch = branch
        eps = config.rms_norm_eps
        self.norm_in = KeelRMSNorm(config.hidden_size, eps) if spec["norm_in"] else None
        self.norm_out = KeelRMSNorm(config.hidden_size, eps, config.out_norm_gain) if spec["norm_out"] else None

    def forward(self, x: torch.Tensor, *branch_args, **branch_kwargs) -> torch.Tensor:
        # x: (B, T, C) fp32 stream
        h = self.norm_in(x) if self.norm_in is not None else x
        skip = h if self.skip_from_norm_in else x
        f = self.branch(h, *branch_args, **branch_kwargs)
        f = (f[0] if isinstance(f, tuple) else f).float()  # attention returns its weights too (output_attentions)
        if self.branch_scale != 1:
            f = f * self.branch_scale
        if self.norm_out is not None:
            return self.norm_out(f, skip, self.alpha)
        return torch.add(f, skip, alpha=self.alpha)


class KeelBlock(GradientCheckpointingLayer):
    def __init__(self, config: KeelConfig, layer_idx: int) -> None:
        super().__init__()
        attn_spec, ffn_spec = config.sublayers[layer_idx]
        self.attn = KeelSublayer(config, attn_spec, KeelAttention(config, layer_idx, attn_spec["qkv_norm"]))
        self.ffn = KeelSublayer(config, ffn_spec, KeelFeedForward(config))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # cache by keyword: under gradient checkpointing (TRL's default) transformers drops it
        return self.ffn(self.attn(x, rope, mask, cache, **kwargs))


class KeelPreTrainedModel(PreTrainedModel):
    config_class = KeelConfig
    config: KeelConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KeelBlock"]
    _supports_sdpa = True
    # output_hidden_states: the stream entering the first block and leaving each block, the last after the final
    # norm; output_attentions: each attention's weights (attn_implementation="eager") - as transformers' Llama
    _can_record_outputs = {"hidden_states": KeelBlock, "attentions": KeelAttention}
    # Keel's per-channel gains multiply over the depth: bf16's 8 mantissa bits would flatten them (docs/export.md)
    _keep_in_fp32_modules_strict = ["norm"]


class KeelModel(KeelPreTrainedModel):
    def __init__(self, config: KeelConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KeelBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = KeelRMSNorm(config.hidden_size, config.rms_norm_eps) if config.final_norm else None
        self.post_init()

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: (B, T) -> cos, sin: (B, 1, T, hd/2), in fp32 as keel.model.rope_tables (no buffer: nothing
        # for transformers' meta-device loading to leave uninitialized)
        hd = self.config.head_dim
        inv_freq = 1.0 / self.config.rope_theta ** (
            torch.arange(0, hd, 2, dtype=torch.float32, device=position_ids.device) / hd
        )
        angles = position_ids[:, None, :, None].float() * inv_freq
        return angles.cos(), angles.sin()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults  # use_cache: the config's, off under gradient checkpointing
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds).float()  # (B, T, C)
        B, T, _ = x.shape
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            if attention_mask is not None and attention_mask.ndim == 2:  # left padding: count real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                past = cache.get_seq_length() if cache is not None else 0
                position_ids = torch.arange(past, past + T, device=x.device).expand(B, T)
        # causal, padded keys hidden, and (with neither a cache nor a 2D mask) packed sequences - position_ids
        # restarting at 0, as TRL's padding-free collator sends them - kept apart; None: plain causal attention
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache, position_ids=position_ids
        )
        rope = self.rope(position_ids)
        for block in self.layers:
            x = block(x, rope, mask, cache=cache, **kwargs)
        if self.norm is not None:
            x = self.norm(x)
        return BaseModelOutputWithPast(last_hidden_state=x, cache=cache if use_cache else None)


class KeelForCausalLM(KeelPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KeelConfig) -> None:
        super().__init__(config)
        self.model = KeelModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (B, T, vocab) in the head's dtype; with labels (B, T), also the mean next-token cross-entropy
        (labels shifted inside, -100 ignored), as Keel's next_token_loss on the same tokens."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        x = outputs.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else outputs.last_hidden_state
        if self.config.logits_multiplier != 1.0:  # muP's readout multiplier, on the fp32 stream as Keel applies it
            x = x * self.config.logits_multiplier
        logits = self.lm_head(x.to(self.lm_head.weight.dtype))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = ["KeelForCausalLM", "KeelModel", "KeelPreTrainedModel"]
