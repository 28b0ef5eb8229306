"""`keel gpu-check`'s command line: the sections to run, each one's failure its own finding, the JSON and the table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import keel.gpu_check
from keel.cli_args import comma_list
from keel.devices import device_name
from keel.errors import ConfigError
from keel.gpu_check.bench import bench
from keel.gpu_check.callbacks import callbacks
from keel.gpu_check.common import sizes_for
from keel.gpu_check.fsdp import checkpoint, fsdp
from keel.gpu_check.multi import multi
from keel.gpu_check.paper import depth, paper
from keel.gpu_check.precision import precision
from keel.gpu_check.pretrain import pretrain
from keel.gpu_check.report import table


def torch_floor() -> str | None:
    """The lowest torch keel declares (its installed metadata), e.g. "2.13"; None where it declares none."""
    from importlib.metadata import requires

    return next((r.removeprefix("torch>=") for r in requires("keel") or () if r.startswith("torch>=")), None)


SECTIONS = {
    "bench": bench,
    "pretrain": pretrain,
    "depth": depth,
    "paper": paper,
    "callbacks": callbacks,
    "multi": multi,
    "fsdp": fsdp,
    "checkpoint": checkpoint,
    "precision": precision,
}
WITH_DATA = ("pretrain", "callbacks", "multi", "fsdp", "checkpoint")  # the sections that train on the data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel gpu-check", description=keel.gpu_check.__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="out/gpu-check", help="where gpu_check.json and the runs go")
    parser.add_argument(
        "--sections", type=comma_list(str), default=list(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "data",
        nargs="*",
        help="data.* overrides for the pretrain runs (default: data=stdlib on "
        "cuda, a few standard-library files on cpu; built under --out)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible; run `make gpu-check DEVICE=cpu` for the CPU version")
    names = args.sections
    if unknown := [name for name in names if name not in SECTIONS]:
        raise ConfigError(f"--sections: unknown {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = sizes_for(args.device)
    data = args.data or [*sizes.data, f"data.dir={out / 'data'}"]
    start, sections = time.perf_counter(), {}
    for name in names:
        section_start = time.perf_counter()
        extra = (data,) if name in WITH_DATA else ()
        try:
            sections[name] = SECTIONS[name](args.device, sizes, out, *extra)
        except Exception as err:  # a broken path is this check's finding, not the end of the others
            sections[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        sections[name]["seconds"] = time.perf_counter() - section_start
        print(f"keel gpu-check: {name} {'ok' if sections[name]['ok'] else 'FAILED'}", file=sys.stderr)
    floor = torch_floor()
    result = {
        "device": args.device,
        "device_name": device_name(torch.device(args.device)),
        "torch": torch.__version__,
        # a torch below keel's floor (installed without its dependencies): a failure may be that torch's
        "torch_below_floor": floor if floor and torch.__version__ < floor else None,
        "seconds": time.perf_counter() - start,
        "ok": all(s["ok"] for s in sections.values()),
        "sections": sections,
    }
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0 if result["ok"] else 1
