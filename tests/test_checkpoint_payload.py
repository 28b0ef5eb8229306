"""Keel's checkpoint payload (keel.checkpoint.payload): what the LightningModule writes reads back whole, checkpoints
in the layout older Keel versions wrote still load and resume, and no other module knows where the payload lies."""

from __future__ import annotations

import ast
import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from keel.checkpoint.payload import LEGACY_DATA_STATE, KeelPayload, read_payload, write_payload
from keel.checkpoint.read import load_model, read_checkpoint
from keel.checkpoint.resume import check_same_model, check_training_state, rescale_batch_progress
from keel.config import to_dict
from keel.errors import ConfigError
from keel.lit import KeelLitModule
from keel.model import KeelLM
from keeltest.distributed import _tiny_cfg

ROOT = Path(__file__).parents[1]


def test_what_the_lightning_module_writes_reads_back_whole():
    cfg = _tiny_cfg()
    module = KeelLitModule(cfg, tokenizer_json="{}", data_manifest_sha256="abc")
    module.heldout = {"step": 4, "loss": 3.25}
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    payload = read_payload(checkpoint)
    assert payload == KeelPayload(
        config=to_dict(cfg), tokenizer_json="{}", heldout={"step": 4, "loss": 3.25}, data_manifest_sha256="abc"
    )
    assert payload.run_config() == cfg
    torch.save(checkpoint, buffer := io.BytesIO())  # plain data: the weights-only reader takes it
    buffer.seek(0)
    assert read_payload(torch.load(buffer, weights_only=True)) == payload
    with pytest.raises(ConfigError, match="^init_from: not a keel checkpoint"):
        read_payload({"state_dict": {}}, "init_from")


@pytest.mark.parametrize("heldout", [None, {"step": 3, "loss": 4.5}])
def test_a_checkpoint_in_the_layout_older_keel_wrote_still_loads_and_resumes(tmp_path, heldout):
    """The "keel" entry as a bare dict of config and tokenizer (heldout added later, absent before that), the shards'
    identity in the data module's state under its class name."""
    cfg = _tiny_cfg()
    model = KeelLM(cfg.model)
    old = {"config": to_dict(cfg), "tokenizer_json": "{}"}
    if heldout is not None:
        old["heldout"] = heldout
    path = tmp_path / "old.ckpt"
    torch.save(
        {
            "keel": old,
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "optimizer_states": [{}],
            "global_step": 3,
            LEGACY_DATA_STATE: {"manifest_sha256": "abc"},
            "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"ready": 6}, "current": {"ready": 6}}}},
        },
        path,
    )

    checkpoint = read_checkpoint(path)
    assert read_payload(checkpoint) == KeelPayload(
        config=to_dict(cfg), tokenizer_json="{}", heldout=heldout, data_manifest_sha256="abc"
    )
    loaded, loaded_cfg, tokenizer_json = load_model(path)
    assert loaded_cfg == cfg and tokenizer_json == "{}"
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    check_same_model(cfg, checkpoint)
    check_training_state(cfg.trainer, path, checkpoint)
    module = KeelLitModule(cfg)
    module.on_load_checkpoint(checkpoint)
    assert module.heldout == heldout
    rescale_batch_progress(checkpoint, 2 * cfg.trainer.grad_accum)  # an elastic resume reads the old config too
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] == 12


def test_the_payload_names_the_shards_whatever_the_data_module_is_called():
    """The shards' identity is the payload's own; the data module's entry is read only where the payload has none."""
    checkpoint = {LEGACY_DATA_STATE: {"manifest_sha256": "old"}}
    write_payload(checkpoint, KeelPayload(config={}, data_manifest_sha256="new"))
    assert read_payload(checkpoint).data_manifest_sha256 == "new"
    del checkpoint[LEGACY_DATA_STATE]
    assert read_payload(checkpoint).data_manifest_sha256 == "new"
    write_payload(checkpoint, replace(read_payload(checkpoint), data_manifest_sha256=None))
    assert read_payload(checkpoint).data_manifest_sha256 is None


def test_no_module_but_the_payload_indexes_the_payload_entry():
    """Every reader goes through read_payload: none indexes a checkpoint's "keel" entry itself."""
    payload = ROOT / "src" / "keel" / "checkpoint" / "payload.py"
    sources = [path for root in (ROOT / "src", ROOT / "callbacks") for path in sorted(root.rglob("*.py"))]
    indexing = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sources
        if path != payload
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Subscript) and getattr(node.slice, "value", None) == "keel"
    ]
    assert not indexing, indexing
