"""The transformers config of a model exported by `keel export` (docs/export.md). Self-contained: it ships inside
every exported directory and needs only transformers.

The blocks are described explicitly, one entry per sublayer, as Keel computed them from the run's scheme, so this
file and modeling_keel.py need not know the schemes: `sublayers[i] = [attention, ffn]`, each a dict of

    norm_in            RMSNorm the sublayer's input before its branch F
    norm_out           RMSNorm the sum:  out = Norm_out(alpha * skip + F(h))     (else out = alpha * skip + F(h))
    alpha              the skip's scale (Keel: L, the number of sublayers)
    skip_from_norm_in  skip = Norm_in(x) instead of x (HybridNorm's FFN)
    qkv_norm           RMSNorm q, k and v per head (HybridNorm's attention)
    branch_scale       F's multiplier, out = ... alpha * skip + branch_scale * F(h) (1 if absent)

`keel` holds the whole run config the model was trained with (its `model` section is every model key), `heldout`
the last held-out loss before the checkpoint exported ({"step", "loss"}; null if none was recorded).
"""

from __future__ import annotations

from transformers.utils.versions import require_version

# Before any import that older versions lack (transformers 4.x has no PreTrainedConfig): a one-line ImportError
# naming the version needed, not a traceback from deep inside. keel.model_card states the same requirement.
require_version("transformers>=5.24")

from transformers import PreTrainedConfig  # noqa: E402

PRE_LN = {
    "norm_in": True,
    "norm_out": False,
    "alpha": 1.0,
    "skip_from_norm_in": False,
    "qkv_norm": False,
    "branch_scale": 1.0,
}


class KeelConfig(PreTrainedConfig):
    model_type = "keel"

    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 16
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None = num_attention_heads
    intermediate_size: int = 512
    hidden_act: str = "gelu"  # gelu (up, GELU, down) | swiglu (up = [gate, value], SiLU(gate) * value, down)
    max_position_embeddings: int = 256  # the sequence length the model was trained on
    rope_theta: float = 1e4
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    out_norm_gain: bool = True  # false: no learnable gain in any Norm_out
    final_norm: bool = True  # an RMSNorm before the head
    # muP (model.parametrization=mup): the head's input times logits_multiplier; q.k times attention_scale
    logits_multiplier: float = 1.0
    attention_scale: float | None = None  # None = 1/sqrt(head_dim)
    sublayers: list | None = None  # [[attention, ffn], ...] per block (above); None = Pre-LN everywhere
    scheme: str = "preln"
    keel: dict | None = None
    trained_steps: int | None = None  # the optimizer steps of the checkpoint exported
    heldout: dict | None = None  # its last validation before that checkpoint: {"step", "loss"}
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.sublayers is None:
            self.sublayers = [[dict(PRE_LN), dict(PRE_LN)] for _ in range(self.num_hidden_layers)]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size}, num_attention_heads {self.num_attention_heads} and "
                f"num_key_value_heads {self.num_key_value_heads} must divide each other in that order"
            )
        if len(self.sublayers) != self.num_hidden_layers or any(len(block) != 2 for block in self.sublayers):
            raise ValueError(f"sublayers must hold [attention, ffn] for each of the {self.num_hidden_layers} blocks")
        if self.hidden_act not in ("gelu", "swiglu"):
            raise ValueError(f"hidden_act must be gelu or swiglu, got {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


__all__ = ["KeelConfig"]
