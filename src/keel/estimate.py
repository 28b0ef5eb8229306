"""`keel estimate [--config FILE] [group=choice ...] [key=value ...]`: a run's memory plan, without starting it.

The config is `keel pretrain`'s, composed the same way. Where the accelerator is a GPU (`trainer.accelerator=gpu`,
or auto with one visible), it prints keel.memory's GPU estimate per GPU by term, with the allocator margin,
against each GPU's memory: the visible GPU's, or `trainer.gpu_memory_gib` on a machine without one (a laptop
planning a cluster run); and what `trainer.activation_checkpointing=auto` chooses. On CPU, its CPU estimate
against the memory available here. Exit status: 0 when the run fits (or the GPU's memory is not known), 1 when it
does not (the changes that would make it fit are printed), 2 for a config error.

    keel estimate recipe=paper model=paper_d128 trainer=fsdp trainer.devices=8 trainer.accelerator=gpu \\
        trainer.gpu_memory_gib=79
"""

from __future__ import annotations

import argparse

from keel.config import Config, load_config, resolve_accelerator
from keel.errors import ConfigError
from keel.memory import (
    ALLOCATOR_MARGIN,
    available_bytes,
    check_training_fits,
    cpu_training_bytes,
    gib,
    gpu_budget_bytes,
    gpu_training_terms,
    remedies,
    resolve_activation_checkpointing,
    resolve_gradient_reduction,
    run_shape,
    with_margin,
)


def gpu_plan(cfg: Config) -> tuple[list[str], bool]:
    """The GPU memory plan's lines, and whether the run fits (True where the GPU's memory is unknown)."""
    model, t = cfg.model, cfg.trainer
    have = gpu_budget_bytes(t)
    terms = gpu_training_terms(model, t)
    need = sum(terms.values())
    source = (
        "trainer.gpu_memory_gib"
        if t.gpu_memory_gib is not None and (have == int(t.gpu_memory_gib * 2**30))
        else "the visible GPU's"
    )
    lines = [
        f"run         {run_shape(model, t)}",
        "per GPU     " + ", ".join(f"{name} {gib(n)}" for name, n in terms.items()),
        f"estimate    {gib(need)} per GPU, {gib(with_margin(need))} with the {ALLOCATOR_MARGIN:.0%} allocator margin",
    ]
    if have is None:
        lines.append(
            "GPU         memory unknown: no GPU is visible here; give it as trainer.gpu_memory_gib=GIB (what "
            'torch reports: an "80 GB" H100 about 79)'
        )
        return lines, True
    fits = with_margin(need) <= have
    lines.append(f"GPU         {gib(have)} ({source})")
    lines.append(
        f"verdict     fits, {gib(have - with_margin(need))} to spare"
        if fits
        else f"verdict     does not fit; change, in this order: {', then '.join(remedies(model, t, have))}"
    )
    return lines, fits


def cpu_plan(cfg: Config) -> tuple[list[str], bool]:
    """The CPU memory plan's lines, and whether the run fits the memory available here."""
    t = cfg.trainer
    need = cpu_training_bytes(cfg, t.checkpointed_blocks(cfg.model.depth))
    lines = [
        f"run         model.depth={cfg.model.depth}, model.width={cfg.model.width}, trainer.micro_batch_size="
        f"{t.micro_batch_size} x model.seq_len={cfg.model.seq_len}, {t.devices} process(es) on this CPU, "
        f"activation checkpointing of {t.checkpointed_blocks(cfg.model.depth)} of {cfg.model.depth} blocks",
        f"estimate    {gib(need)} (fitted to peak RSS, which includes the allocator's slack)",
        f"memory      {gib(available_bytes())} available here",
    ]
    try:
        check_training_fits(cfg)
    except ConfigError as refusal:
        return [*lines, f"verdict     does not fit: {refusal}"], False
    return [*lines, "verdict     fits"], True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel estimate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML merged over conf/config.yaml (as keel pretrain's)")
    parser.add_argument("overrides", nargs="*", help="group=choice (model=paper_d64) or key.path=value")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    chosen = [line for line in (resolve_activation_checkpointing(cfg), resolve_gradient_reduction(cfg)) if line]
    lines, fits = (gpu_plan if resolve_accelerator(cfg.trainer) == "gpu" else cpu_plan)(cfg)
    lines[1:1] = [f"auto        {line}" for line in chosen]
    print("\n".join(lines))
    return 0 if fits else 1
