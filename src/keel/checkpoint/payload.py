"""What Keel keeps in a checkpoint beside Lightning's state: one payload type, written by the LightningModule into
every checkpoint (keel.lit), built for a directory `keel export` wrote (keel.checkpoint.exported), and read by every
consumer through read_payload. The only module that knows where in a checkpoint it lies."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from keel.config import Config, from_dict
from keel.errors import ConfigError

PAYLOAD = "keel"  # the checkpoint entry holding it (a plain dict: torch.load(weights_only=True) reads it)
# Where checkpoints written before the payload held the shards' identity keep it: Lightning saves a data module's
# state_dict under its class name, which the data module then had
LEGACY_DATA_STATE = "KeelDataModule"


@dataclass(frozen=True)
class KeelPayload:
    """config: the run's config as a dict (keel.config.to_dict; read in today's spelling by `run_config`);
    tokenizer_json: the tokenizer's JSON, all evaluation needs besides the weights; heldout: the last validation
    before the checkpoint, {"step", "loss"}, or None (saved before the run's first validation, or by an older Keel);
    data_manifest_sha256: the identity of the shards the run trained on (a saved loader position refers to them
    only), or None where the checkpoint does not say (an export, or one saved before Keel recorded it)."""

    config: dict
    tokenizer_json: str | None = None
    heldout: dict | None = None
    data_manifest_sha256: str | None = None

    def run_config(self) -> Config:
        return from_dict(self.config)


def has_payload(checkpoint: dict) -> bool:
    return isinstance(checkpoint.get(PAYLOAD), dict)


def write_payload(checkpoint: dict, payload: KeelPayload) -> None:
    """Put payload into checkpoint (Lightning's dict, or the one keel.checkpoint.exported builds for an export)."""
    checkpoint[PAYLOAD] = asdict(payload)


def read_payload(checkpoint: dict, what: str = "checkpoint") -> KeelPayload:
    """The payload of a checkpoint, of any Keel version: entries written before one was added read as None.
    what names the checkpoint in the error (e.g. "init_from")."""
    if not has_payload(checkpoint):
        raise ConfigError(f"{what}: not a keel checkpoint (no '{PAYLOAD}' entry)")
    saved = checkpoint[PAYLOAD]
    data = saved.get("data_manifest_sha256") or checkpoint.get(LEGACY_DATA_STATE, {}).get("manifest_sha256")
    return KeelPayload(
        config=saved["config"],
        tokenizer_json=saved.get("tokenizer_json"),
        heldout=saved.get("heldout"),
        data_manifest_sha256=data,
    )
