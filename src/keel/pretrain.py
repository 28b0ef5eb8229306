"""`keel pretrain [--config FILE] [--print-config] [group=choice ...] [key=value ...]`: train (or resume) a run."""

from __future__ import annotations

import argparse

from omegaconf import OmegaConf

from keel.config import GROUPS, Config, conf_dir, load_config, to_dict, to_yaml
from keel.config.model import init_description


def resolved_comment(cfg: Config) -> str:
    """What the keys resolve to that no key shows (the init in force, muP's multipliers), as YAML comments: the
    printed config still loads."""
    lines = [f"init in force: {init_description(cfg.model)}"]
    if cfg.model.parametrization == "mup":
        lines.append(
            f"mup: hidden matrices' peak LR {cfg.optim.lr * cfg.model.mup_ratio:.4g} (optim.lr x "
            f"{cfg.model.mup_ratio:.4g}), the rest at optim.lr {cfg.optim.lr:.4g}"
        )
    return "\n".join(f"# {line}" for line in lines)


def config_help() -> str:
    """The config groups with their choices (conf/<group>/*.yaml) and the sections of keys, for --help."""
    default_choice = OmegaConf.load(conf_dir() / "config.yaml").defaults
    lines = ["config groups (group=choice picks conf/<group>/<choice>.yaml, or group=FILE.yaml; * = default):"]
    for group in GROUPS:
        choices = sorted(path.stem for path in (conf_dir() / group).glob("*.yaml"))
        marked = [f"{choice}*" if choice == default_choice[group] else choice for choice in choices]
        lines.append(f"  {group:<9} {', '.join(marked)}")
    sections = ", ".join(f"{key}.*" if isinstance(value, dict) else key for key, value in to_dict(Config()).items())
    lines += [
        "",
        f"keys (key.path=value): {sections}",
        "`keel pretrain --print-config [overrides]` prints every key with its value; e.g.",
        "  keel pretrain model=paper_d64 trainer=fsdp trainer.devices=8 optim.lr=1e-3 "
        "trainer.loggers=[tensorboard,csv]",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel pretrain",
        description=__doc__,
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML merged over conf/config.yaml")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config (every key) and exit")
    parser.add_argument("overrides", nargs="*", help="group=choice (model=paper_d64) or key.path=value")
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of --config
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        print(resolved_comment(cfg))
        return 0
    # Lightning and torch load only now: a config error above is reported in a fraction of their start-up time
    from keel.training import failure_exit_code, train

    return failure_exit_code(cfg, train(cfg))
