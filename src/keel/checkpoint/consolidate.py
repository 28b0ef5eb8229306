"""`keel consolidate SHARDED_DIR OUT.ckpt`: a sharded (FSDP) checkpoint as one file."""

from __future__ import annotations

import argparse
from pathlib import Path

from keel.checkpoint.read import read_checkpoint
from keel.checkpoint.write import AtomicCheckpointIO
from keel.errors import ConfigError, refuse_output


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel consolidate",
        description="Assemble a sharded (FSDP) checkpoint directory into one file that `keel eval` and "
        "keel.checkpoint.read.load_model read: the full model weights, the run's config, tokenizer and training "
        "progress, without the optimizer state (resume from the sharded directory itself).",
    )
    parser.add_argument("sharded_dir", help="e.g. runs/NAME/checkpoints/last.ckpt (a directory under trainer=fsdp)")
    parser.add_argument("output", help="the single-file checkpoint to write, e.g. NAME.ckpt")
    args = parser.parse_args(argv)
    if not Path(args.sharded_dir).is_dir():
        raise ConfigError(
            f"consolidate: {args.sharded_dir} is not a sharded checkpoint directory "
            "(a single-file checkpoint is already what load_model reads)"
        )
    refuse_output(Path(args.output), "consolidate", "output path")
    checkpoint = read_checkpoint(args.sharded_dir)
    AtomicCheckpointIO().save_checkpoint(checkpoint, args.output)
    params = sum(tensor.numel() for tensor in checkpoint["state_dict"].values())
    print(f"keel consolidate: wrote {args.output}: {params:,} parameters, step {checkpoint.get('global_step')}")
    return 0
