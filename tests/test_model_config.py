"""model.* as numbers and errors: parameter counts (the estimate is the built model's) and a bad config naming
the field."""

from __future__ import annotations

import pytest

from keel.config.model import SCHEMES
from keel.errors import ConfigError
from keel.model import KeelLM
from keeltest.model import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


# width 32, 4 heads of 8, 2 KV heads, FFN hidden 128, vocab 64, depth 3
QKV, OUT = 32 * (4 + 2 * 2) * 8, 32 * 32
GELU_FFN, SWIGLU_FFN = 2 * 32 * 128, 3 * 32 * 128
EMBED = HEAD = 64 * 32
C, HEAD_DIM = 32, 8


@pytest.mark.parametrize(
    "overrides, norm_params",
    [
        ({"scheme": "preln"}, 6 * C + C),  # norm_in per sublayer + final
        ({"scheme": "postln"}, 6 * C),  # norm_out per sublayer
        ({"scheme": "postln", "postln_final_norm": True}, 7 * C),
        ({"scheme": "deepnorm"}, 6 * C),
        ({"scheme": "mixln"}, 6 * C + C),
        ({"scheme": "keel"}, 2 * C + 2 * 4 * C),  # block 0: two norm_in; then norm_in + norm_out per sublayer
        ({"scheme": "keel", "keel_first_block": "v2"}, 3 * C + 2 * 4 * C),  # block 0's FFN keeps its norm_out
        ({"scheme": "keel", "keel_inner_norm": False}, 2 * C + 2 * 2 * C),  # blocks 1-2: norm_out only
        ({"scheme": "keel", "out_norm_gain": False}, 2 * C + 2 * 2 * C),  # blocks 1-2: norm_in only
        ({"scheme": "postln", "out_norm_gain": False}, 0),
        ({"scheme": "hybridnorm"}, 3 * (3 * HEAD_DIM + C) + C),  # q/k/v norms + FFN norm per block, final
        ({"scheme": "hybridnorm_star"}, 3 * (3 * HEAD_DIM + C) + C + C),  # + block 0's attention norm_in
    ],
)
@pytest.mark.parametrize("ffn", ["gelu", "swiglu"])
def test_parameter_counts(overrides, norm_params, ffn):
    cfg = tiny(depth=3, n_heads=4, n_kv_heads=2, ffn=ffn, **overrides)
    matrices = 3 * (QKV + OUT + (GELU_FFN if ffn == "gelu" else SWIGLU_FFN))
    assert KeelLM(cfg).num_params() == EMBED + HEAD + matrices + norm_params
    assert KeelLM(tiny(depth=3, n_heads=4, n_kv_heads=2, ffn=ffn, tie_embeddings=True, **overrides)).num_params() == (
        EMBED + matrices + norm_params
    )


@pytest.mark.parametrize(
    "overrides, key, allowed",
    [
        ({"scheme": "resnet"}, "model.scheme", "allowed: keel, preln"),
        ({"ffn": "relu"}, "model.ffn", "allowed: gelu, swiglu"),
        ({"init": "kaiming"}, "model.init", "allowed: auto, normal, gpt2, megatron, xavier, mixln, unit"),
        ({"keel_first_block": "v3"}, "model.keel_first_block", "allowed: v1, v2"),
        ({"scheme": "preln", "keel_inner_norm": False}, "model.keel_inner_norm", "scheme keel only"),
        ({"scheme": "hybridnorm", "out_norm_gain": False}, "model.out_norm_gain", "has no Norm_out"),
        ({"scheme": "mixln", "depth": 3, "out_norm_gain": False}, "model.out_norm_gain", "has no Norm_out"),
        ({"depth": 0}, "model.depth", ">= 1"),
        ({"width": 30, "n_heads": 4}, "model.width", "divisible by model.n_heads"),
        ({"width": 12, "n_heads": 4}, "model.width", "must be even"),
        ({"n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads", "divisor of model.n_heads"),
        ({"n_kv_heads": 0}, "model.n_kv_heads", "divisor of model.n_heads"),
        ({"vocab_size": 0}, "model.vocab_size", ">= 1"),
        ({"seq_len": 0}, "model.seq_len", ">= 1"),
        ({"ffn_mult": 0}, "model.ffn_mult", "> 0"),
        ({"norm_eps": 0}, "model.norm_eps", "> 0"),
        ({"mixln_post_fraction": 1.5}, "model.mixln_post_fraction", "[0, 1]"),
        ({"keel_alpha": 0.0}, "model.keel_alpha", "> 0"),
        ({"deepnorm_beta": -1.0}, "model.deepnorm_beta", "> 0"),
        ({"loss_chunk": -1}, "model.loss_chunk", ">= 0 (tokens per chunk; 0 = plain head) or null"),
    ],
)
def test_bad_config_names_the_field(overrides, key, allowed):
    with pytest.raises(ConfigError) as err:
        tiny(**overrides)
    assert str(err.value).startswith(f"{key}:") and allowed in str(err.value)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_the_one_parameter_count_is_the_built_models(scheme):
    """parameter_counts (meta device, no allocation) is what a built model holds, for every scheme, tied or not."""
    from keel.model import parameter_counts

    for tied in (False, True):
        cfg = tiny(scheme=scheme, depth=5, tie_embeddings=tied, mixln_post_fraction=0.4)
        assert sum(parameter_counts(cfg).values()) == sum(p.numel() for p in KeelLM(cfg).parameters())
