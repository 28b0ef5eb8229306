"""The GPU memory estimate (keel.gpu_memory), on CPU: the GPU's memory is passed in."""

from __future__ import annotations

import pytest

from keel.config import load_config
from keel.errors import ConfigError
from keel.gpu_memory import activation_bytes, block_bytes_per_token, check_gpu_fits, gpu_training_terms
from keel.schemes import SCHEMES, ModelConfig, sublayer_specs

GB80 = 80 * 10**9


def paper_d64(*overrides: str):
    return load_config(overrides=["model=paper_d64", "trainer.accelerator=gpu", "trainer.devices=8",
                                  "trainer.micro_batch_size=8", *overrides])


@pytest.mark.parametrize(("scheme", "kib"), [("keel", 55), ("preln", 47)])
def test_activations_per_token_and_block_reproduce_the_measured_figures(scheme, kib):
    # issue #35: eager saved-for-backward at width 1024 under bf16, Keel 55 KiB and Pre-LN 47 KiB per token per block
    cfg = ModelConfig(scheme=scheme, depth=4, width=1024, n_heads=16, n_kv_heads=8, ffn="swiglu", ffn_mult=3.0)
    per_block = block_bytes_per_token(cfg, sublayer_specs(cfg)[-1], compute_bytes=2)
    assert per_block / 2**10 == pytest.approx(kib, rel=0.05)


def saved_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Bytes of the distinct storages one forward under bf16 autocast keeps for its backward."""
    import torch

    from keel.model import KeelLM

    torch.manual_seed(0)
    model, storages = KeelLM(cfg), {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    idx = torch.randint(0, cfg.vocab_size, (1, tokens))
    bf16_mixed = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)  # as Lightning's
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), bf16_mixed:
        model(idx, targets=idx)
    return sum(storages.values())


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("ffn", ["gelu", "swiglu"])
def test_activations_per_token_match_what_autograd_saves(scheme, ffn):
    def config(depth):
        return ModelConfig(scheme=scheme, depth=depth, width=64, n_heads=4, n_kv_heads=2, ffn=ffn, seq_len=32,
                           vocab_size=64, loss_chunk=0)

    # the difference of depths 4 and 2 and of 32 and 16 tokens: what grows with both, i.e. per token and block
    measured = saved_bytes(config(4), 32) - saved_bytes(config(2), 32) - saved_bytes(config(4), 16) + saved_bytes(
        config(2), 16)
    assert measured == 16 * (activation_bytes(config(4), 1, 2, False) - activation_bytes(config(2), 1, 2, False))


def test_paper_d64_on_8_gpus_of_80_gb_under_ddp_is_refused_with_numbers_and_keys():
    with pytest.raises(ConfigError) as err:
        check_gpu_fits(paper_d64("trainer=ddp"), GB80)
    message = str(err.value)
    assert "\n" not in message
    assert "needs about 76.3 GiB per GPU" in message and "more than the 74.5 GiB of this GPU" in message
    assert "activations 55.0 GiB" in message and "AdamW state 6.8 GiB" in message and "DDP buckets 3.4 GiB" in message
    assert "55.0 KiB per token per block" in message
    assert "change, in this order: trainer.activation_checkpointing=true (-> 24.7 GiB)" in message
    assert message.endswith("or set trainer.check_memory=false to start anyway")


def test_paper_d64_with_activation_checkpointing_under_fsdp_fits():
    cfg = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=true")
    check_gpu_fits(cfg, GB80)
    terms = gpu_training_terms(cfg.model, cfg.trainer)
    assert terms["AdamW state"] == pytest.approx(8 * 908e6 / 8, rel=0.01)  # sharded over the 8 GPUs
    # HSDP on 2 nodes: sharded over a node's 8 GPUs, not the 16 of the run
    hsdp = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=true", "trainer.num_nodes=2", "trainer.hsdp=true")
    assert gpu_training_terms(hsdp.model, hsdp.trainer)["AdamW state"] == terms["AdamW state"]
    fsdp16 = paper_d64("trainer=fsdp", "trainer.activation_checkpointing=true", "trainer.num_nodes=2")
    assert gpu_training_terms(fsdp16.model, fsdp16.trainer)["AdamW state"] == pytest.approx(terms["AdamW state"] / 2, rel=1e-3)


def test_the_refusal_orders_the_remedies_by_what_they_save():
    # paper_d512 under ddp needs both: checkpointing first (activations dominate), then FSDP
    with pytest.raises(ConfigError, match=r"trainer.activation_checkpointing=true \(-> [\d.]+ GiB\), then "
                                          r"trainer.strategy=fsdp \(-> [\d.]+ GiB\); or set trainer.check_memory"):
        check_gpu_fits(load_config(overrides=["model=paper_d512", "trainer=ddp", "trainer.devices=8",
                                              "trainer.accelerator=gpu"]), GB80)
    # one GPU cannot shard: a smaller micro-batch (same global batch), then more GPUs or memory
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=1 trainer.grad_accum=8 \(-> [\d.]+ GiB\), then "
                                          "more GPUs under trainer.strategy=fsdp"):
        check_gpu_fits(load_config(overrides=["model=paper_d512", "trainer=gpu"]), GB80)


def test_the_plain_loss_head_counts_the_full_logits():
    chunked, plain = (gpu_training_terms(paper_d64(f"model.loss_chunk={c}").model, paper_d64().trainer)["loss head"]
                      for c in ("null", 0))
    assert plain > 8 * chunked  # 16,384 tokens x 50,304 logits, against one chunk of 1,024


def test_keel_pretrain_on_a_gpu_checks_before_anything_is_made(tmp_path, monkeypatch, capsys):
    import torch

    from keel.cli import main as cli_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("keel.training.gpu_memory_bytes", lambda: GB80)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set_threads writes it; restored after the test
    argv = ["pretrain", "model=paper_d64", "trainer=ddp", "trainer.devices=8",
            f"trainer.threads={torch.get_num_threads()}", f"run.dir={tmp_path / 'run'}"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "needs about 76.3 GiB per GPU" in err and "trainer.check_memory=false" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["paper_d128", "paper_d256", "paper_d512"])
def test_the_deep_paper_configs_need_activation_checkpointing_and_their_documented_command_fits(model):
    overrides = [f"model={model}", "trainer=fsdp", "trainer.devices=8", "trainer.accelerator=gpu"]
    with pytest.raises(ConfigError, match="change, in this order: trainer.activation_checkpointing=true"):
        check_gpu_fits(load_config(overrides=overrides), GB80)
    check_gpu_fits(load_config(overrides=[*overrides, "trainer.activation_checkpointing=true"]), GB80)  # conf/model
