"""What the runners (`keel maxlr`, `keel sweep`) share to lay out and launch a grid: a cell of it, and the SLURM
array script that runs one command per cell."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass
class GridCell:
    """One run of a runner's grid: its directory name, its value on each axis, its config overrides."""

    name: str
    axes: dict[str, str]  # axis -> the value as given (alpha stays symbolic)
    overrides: list[str]


def slurm_script(commands: list[str], out: Path, sbatch: list[str]) -> str:
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=keel-sweep",
        f"#SBATCH --array=0-{len(commands) - 1}",
        f"#SBATCH --output={out}/slurm-%A_%a.out",
        *(f"#SBATCH {option}" for option in sbatch),
        "# one command per array task, run from the submission directory",
        "set -euo pipefail",
        "COMMANDS=(",
        *(f"  {shlex.quote(command)}" for command in commands),
        ")",
        'eval "${COMMANDS[$SLURM_ARRAY_TASK_ID]}"',
    ]
    return "\n".join(lines) + "\n"
