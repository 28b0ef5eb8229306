"""One typed config drives everything (litgpt style), composed from `conf/` groups (Hydra style):

    keel pretrain [--config FILE] [group=choice ...] [key.path=value ...]

`conf/config.yaml` names the default choice of each group (`model`, `data`, `trainer`, `eval`, `recipe`); a
`group=choice` override picks `conf/<group>/<choice>.yaml` (or a YAML path), merged into that section (a recipe's
file, which sets optimizer and trainer keys together, into the whole config, after the other groups).
`--config FILE` merges on top of `conf/config.yaml`, then dotlist overrides on top of both (loading.py).

The package holds every schema, one module per subject, and imports nothing of the engine (no torch, no Lightning):
the engine maps the names it validates (schemes, inits, sources, callbacks, loggers) to its own code.
"""

from keel.config.callbacks import CALLBACKS
from keel.config.data import SOURCES, DataConfig, HFConfig, SourceConfig, StdlibConfig, TextFilesConfig
from keel.config.loading import GROUPS, conf_dir, from_dict, load_config, to_dict, to_yaml
from keel.config.model import ModelConfig
from keel.config.optim import OptimConfig
from keel.config.run import Config, RunConfig
from keel.config.trainer import TrainerConfig, resolve_accelerator, resolve_precision

__all__ = [
    "CALLBACKS",
    "GROUPS",
    "SOURCES",
    "Config",
    "DataConfig",
    "HFConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SourceConfig",
    "StdlibConfig",
    "TextFilesConfig",
    "TrainerConfig",
    "conf_dir",
    "from_dict",
    "load_config",
    "resolve_accelerator",
    "resolve_precision",
    "to_dict",
    "to_yaml",
]
