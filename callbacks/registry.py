"""The configurable callbacks by name: keel.config.callbacks holds each one's options (`callbacks.<name>.*`,
`eval.*`) and run order, BUILDERS here how each is built from the run's config. Adding a callback: its options class
there (and its CALLBACKS entry), its module here and its BUILDERS entry."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.callbacks import Callback

from keel.callbacks.grad_norms import GradNormMonitor
from keel.callbacks.layer_importance import LayerImportance
from keel.callbacks.stability import StabilityMonitor
from keel.callbacks.throughput import ThroughputMonitor
from keel.config import CallbackConfig, Config
from keel.flops import flops_per_token


def _downstream_eval(options: CallbackConfig, cfg: Config) -> Callback:
    from keel.callbacks.downstream_eval import DownstreamEval  # lm-eval loads slowly: imported for runs that evaluate

    return DownstreamEval(cfg)


# callbacks.<name> (and eval) -> the callback, from its options and the run's config
BUILDERS: dict[str, Callable[[CallbackConfig, Config], Callback]] = {
    "grad_norms": lambda options, cfg: GradNormMonitor(options),
    "stability": lambda options, cfg: StabilityMonitor(options, cfg.run.dir,
                                                       cfg.device_tokens_per_step * cfg.trainer.world_size),
    "throughput": lambda options, cfg: ThroughputMonitor(cfg.device_tokens_per_step, flops_per_token(cfg.model),
                                                         options),
    "layer_importance": lambda options, cfg: LayerImportance(options),
    "eval": _downstream_eval,
}


def configured_callbacks(cfg: Config) -> list[Callback]:
    """The enabled configurable callbacks (callbacks.*, eval), in their run order (Config.callback_configs)."""
    return [BUILDERS[options.name](options, cfg) for options in cfg.callback_configs()]
