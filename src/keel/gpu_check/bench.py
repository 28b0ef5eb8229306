"""The bench section: `keel bench --dtype bf16 --compile on`, Keel against Pre-LN, at a ~350M-parameter config and
at model=paper_d64's width 1024 with 8 blocks: tokens/s, MFU against the device's dense bf16 peak (keel.flops),
peak memory."""

from __future__ import annotations

import json
from pathlib import Path

from keel.gpu_check.common import Sizes, failed, keel


def bench(device: str, sizes: Sizes, out: Path) -> dict:
    configs = {}
    for label, options in sizes.bench.items():
        path = out / f"bench-{len(configs)}.json"
        done = keel(
            "bench",
            "--device",
            device,
            "--dtype",
            "bf16",
            "--compile",
            sizes.bench_compile,
            "--schemes",
            "keel,preln",
            *options,
            "--json",
            str(path),
            timeout=300,
        )
        if error := failed(done):
            configs[label] = {"ok": False, "error": error}
            continue
        result = json.loads(path.read_text())
        rows = {row["scheme"]: row for row in result["rows"]}
        configs[label] = {
            "ok": all(row["tokens_per_s"] > 0 for row in rows.values()),
            "peak_flops": result["peak_flops"],
            "peak_flops_source": result["peak_flops_source"],
            **{
                scheme: {key: row[key] for key in ("tokens_per_s", "mfu", "peak_memory_bytes", "ratio")}
                for scheme, row in rows.items()
            },
            "table": done.stdout.strip(),
        }
    return {"ok": all(c["ok"] for c in configs.values()), "configs": configs}
