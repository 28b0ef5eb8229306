"""`keel gpu-check`'s printed table: each section's verdict, figures, thresholds and checks."""

from __future__ import annotations

import json

from keel.gpu_check.common import mb


def table(result: dict) -> str:
    lines = [
        f"keel gpu-check: {result['device_name']}, torch {result['torch']}, {result['seconds']:.0f} s: "
        f"{'PASS' if result['ok'] else 'FAIL'}",
        "",
    ]
    if floor := result.get("torch_below_floor"):
        lines[1:1] = [
            f"warning: torch {result['torch']} is below the torch>={floor} keel declares; a failure here may "
            "be that torch's, not keel's",
            "",
        ]
    for name, section in result["sections"].items():
        lines.append(f"[{'ok' if section['ok'] else 'FAIL'}] {name} ({section['seconds']:.0f} s)")
        if "error" in section:
            lines.append(f"    error: {section['error'].splitlines()[-1] if section['error'] else ''}")
        for label, config in section.get("configs", {}).items():
            lines.append(
                f"    {label}: "
                + (
                    "; ".join(
                        f"{scheme} {config[scheme]['tokens_per_s']:,.0f} tok/s, MFU {config[scheme]['mfu']:.1%}, "
                        f"peak {mb(config[scheme]['peak_memory_bytes'])}"
                        for scheme in ("keel", "preln")
                    )
                    if config["ok"]
                    else f"FAIL {config['error'].splitlines()[-1]}"
                )
            )
        for label, run in section.get("runs", {}).items():
            lines.append(
                f"    {label}: "
                + (
                    f"loss {run['loss_first10']:.3f} -> {run['loss_last10']:.3f} (means of the first / last 10 steps), "
                    f"resumed {run['loss_resumed'][0]:.3f}, {run['seconds_50_steps']:.0f} s for 50 steps"
                    if "checks" in run
                    else "FAIL " + run["error"].splitlines()[-1]
                )
            )
            lines += [
                f"        {'ok' if passed else 'FAIL'}: {check}" for check, passed in run.get("checks", {}).items()
            ]
        for label, run in section.get("paper_runs", {}).items():
            lines.append(
                f"    {label} ({run.get('shape', '-')}): "
                + (
                    f"{run['step_ms']:,.0f} ms/step, {run['tokens_per_s']:,.0f} tok/s, MFU "
                    + ("-" if run["mfu"] is None else f"{run['mfu']:.1%}")
                    + f", peak {mb(run['peak_memory_bytes'])} (estimate {mb(run['estimated_memory_bytes'])}), "
                    f"SDPA {','.join(run['sdpa'])}, {json.dumps(run['compile'])}, checkpoint "
                    f"{mb(run['checkpoint_bytes'])} in {run['checkpoint_save_s']:.1f} s, "
                    f"loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}"
                    if "step_ms" in run
                    else "FAIL " + run["error"].splitlines()[-1]
                )
            )
        for label, run in section.get("callback_runs", {}).items():
            lines.append(
                f"    {label}: "
                + (
                    f"{run['step_ms']:,.1f} ms/step"
                    + (
                        f" (what it turned off: {run['cost_ms']:+,.1f} ms/step)"
                        if label != "all on" and "cost_ms" in run
                        else ""
                    )
                    if run["ok"]
                    else "FAIL " + run["error"].splitlines()[-1]
                )
            )
        if section.get("deepest"):
            deepest = section["deepest"]
            lines.append(
                f"    deepest fitting: {deepest['depth']} blocks ({deepest['params']:,} parameters), "
                f"peak {mb(deepest['peak_memory_bytes'])}; tried "
                + ", ".join(f"{t['depth']}{'' if t['fits'] else ' (out of memory)'}" for t in section["tried"])
            )
        if "skipped" in section:
            lines.append(f"    skipped: {section['skipped']}")
        for label, run in section.get("fsdp_runs", {}).items():
            lines.append(
                f"    {label}: "
                + (
                    "FAIL " + run["error"].splitlines()[-1]
                    if run["error"]
                    else "tokens/s per device "
                    + ("-" if run["tokens_per_s_per_device"] is None else f"{run['tokens_per_s_per_device']:,.0f}")
                    + ", MFU "
                    + ("-" if run["mfu"] is None else f"{run['mfu']:.1%}")
                )
            )
        for mode, save in section.get("saves", {}).items():
            lines.append(
                f"    {mode} save: {mb(save['bytes'])}, "
                + ", ".join(
                    f"{key.removesuffix('_s')} " + ("-" if save[key] is None else f"{save[key]:.2f} s")
                    for key in ("blocking_s", "waited_s", "total_s")
                )
            )
        for label, row in section.get("thresholds", {}).items():
            lines.append(
                f"    [skipped] {label}: {row['skipped']}"
                if "skipped" in row
                else f"    [{'ok' if row['ok'] else 'FAIL'}] {label}: {row['shown']} "
                f"(threshold {row['threshold']}: {row['source']})"
            )
        for label, check in section.get("checks", {}).items():
            if isinstance(check, bool):  # the multi section's checks
                lines.append(f"    [{'ok' if check else 'FAIL'}] {label}")
                continue
            figures = {k: v for k, v in check.items() if k != "ok"}
            lines.append(f"    [{'ok' if check['ok'] else 'FAIL'}] {label}: {json.dumps(figures)}")
    return "\n".join(lines)
