"""Continued pretraining: `init_from=CKPT` starts a fresh run from a checkpoint's model weights."""

from __future__ import annotations

import pytest
import torch

from keel.checkpoint.layout import LAST
from keel.checkpoint.read import load_model, read_checkpoint
from keel.config import load_config
from keel.data.loading import open_dataset
from keel.data.preparation import main as data_main
from keel.errors import ConfigError
from keel.lit import KeelLitModule
from keel.model import KeelLM, next_token_loss
from keel.training import start_from, train
from keeltest import write_sharded
from keeltest.runs import FOUR_STEP_RUN, CrashAtStep, FirstBatch, scalars, tiny_config


def test_first_step_loss_is_the_source_checkpoints_loss(tiny_data, tiny_run, tmp_path):
    source = tiny_run / "checkpoints" / LAST
    run = tmp_path / "continued"
    first = FirstBatch()
    cfg = tiny_config(tiny_data, run, *FOUR_STEP_RUN, f"init_from={source}")
    train(cfg, extra_callbacks=[first])

    model, _, _ = load_model(source)
    with torch.no_grad():
        expected = next_token_loss(model, first.batch).item()
        untrained = next_token_loss(KeelLM(cfg.model), first.batch).item()
    assert scalars(run, "train/loss")[0] == pytest.approx(expected, rel=1e-6)
    assert expected < untrained - 0.3  # the source had learnt something: the comparison can tell them apart
    # a fresh run: its own schedule from step 0 (the source ended its warm-up long ago), step count and record
    assert scalars(run, "lr/matrices")[0] == pytest.approx(cfg.optim.lr / 4)
    assert read_checkpoint(run / "checkpoints" / LAST, weights=False)["global_step"] == 4
    assert f"init_from: {source.resolve()}" in (run / "config.yaml").read_text()


def test_resume_of_a_continued_run_keeps_its_own_progress(tiny_data, tiny_run, tmp_path):
    source = f"init_from={tiny_run / 'checkpoints' / LAST}"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(tiny_config(tiny_data, straight, *FOUR_STEP_RUN, source))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(tiny_data, crashed, *FOUR_STEP_RUN, source), extra_callbacks=[CrashAtStep(3)])
    train(tiny_config(tiny_data, crashed, *FOUR_STEP_RUN, source, "resume=auto"))  # from its step 2, not the source
    assert scalars(crashed, "train/loss") == scalars(straight, "train/loss")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_init_from_reads_sharded_and_refuses_another_model(tiny_data, tiny_run, tmp_path):
    source = tiny_run / "checkpoints" / LAST
    expected, _, _ = load_model(source)
    sharded = write_sharded(source, tmp_path / "sharded.ckpt")
    cfg = tiny_config(tiny_data, tmp_path / "run", f"init_from={sharded}")
    module = KeelLitModule(cfg, tokenizer_json=expected_tokenizer(source))
    assert "model weights of" in start_from(cfg, module, ckpt_path=None)
    torch.testing.assert_close(module.model.state_dict(), expected.state_dict(), rtol=0, atol=0)

    cfg = tiny_config(tiny_data, tmp_path / "run", f"init_from={source}", "model.depth=3", "model.width=64")
    with pytest.raises(
        ConfigError,
        match=r"init_from: the checkpoint holds a different model; model.depth: "
        r"checkpoint 2 != config 3; model.width: checkpoint 32 != config 64",
    ):
        start_from(cfg, KeelLitModule(cfg), ckpt_path=None)

    with pytest.raises(ConfigError, match="checkpoint: no file or directory at"):
        start_from(load_config(overrides=["init_from=/nonexistent.ckpt"]), module, ckpt_path=None)


def test_new_data_must_use_the_sources_tokenizer(tiny_data, tiny_run, tmp_path):
    """Phase two on new shards: built with the source's tokenizer.json they are accepted, with a BPE of their own
    (another vocabulary) refused, naming the data.tokenizer to use."""
    source = tiny_run / "checkpoints" / LAST
    source_data = load_config(overrides=tiny_data).data.dir
    for name, tokenizer in (("same", f"data.tokenizer={source_data}/tokenizer.json"), ("other", "data.vocab_size=400")):
        data = [*tiny_data, f"data.dir={tmp_path / name}", tokenizer]
        assert data_main(data) == 0
        cfg = tiny_config(data, tmp_path / f"run-{name}", f"init_from={source}")
        module = KeelLitModule(cfg, tokenizer_json=open_dataset(cfg).tokenizer_json)
        if name == "same":
            assert "model weights of" in start_from(cfg, module, ckpt_path=None)
        else:
            with pytest.raises(
                ConfigError,
                match=rf"was trained with another tokenizer than {tmp_path / name}'s; build "
                rf"the new data with that tokenizer \(data.tokenizer={source_data}/",
            ):
                start_from(cfg, module, ckpt_path=None)


def expected_tokenizer(checkpoint) -> str:
    return read_checkpoint(checkpoint, weights=False)["keel"]["tokenizer_json"]
