"""keel.config is the bottom of the import order: it loads no torch, no Lightning and nothing of the engine (the
callbacks' options, which it finds in keel.callbacks.options, are torch-free too), and every name it validates (init
kinds, data sources, callbacks, loggers) is one the engine maps to its own code."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import keel.callbacks.options
import keel.config.trainer
from keel.callbacks.options.downstream_eval import EvalConfig
from keel.config import (
    CALLBACKS,
    SOURCES,
    Config,
    DataConfig,
    ModelConfig,
    TextFilesConfig,
    from_dict,
    load_config,
    to_dict,
)
from keel.config.data import MOVED_KEYS, new_spelling
from keel.config.loading import _valid_keys
from keel.config.model import INITS, init_description
from keel.data import sources
from keel.errors import ConfigError
from keel.loggers import LOGGERS
from keel.model import INITS as INIT_FUNCTIONS
from keel.model import KeelLM

ENGINE = ("torch", "lightning", "lm_eval", "litdata")


def loaded_after(statement: str) -> list[str]:
    """The modules a fresh interpreter holds after `statement`."""
    script = f"import sys\n{statement}\nimport json; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout)


def test_importing_the_config_loads_nothing_of_the_engine():
    modules = loaded_after("import keel.config; keel.config.load_config()")
    assert not [m for m in modules if m.split(".")[0] in ENGINE]
    keel_modules = [m for m in modules if m.split(".")[0] == "keel"]
    assert [
        m
        for m in keel_modules
        if m not in ("keel", "keel.errors", "keel.conf", "keel.callbacks")
        and not m.startswith(("keel.config", "keel.callbacks.options"))
    ] == []
    # (the check above looked at what it should)
    assert {"keel.config.model", "keel.callbacks.options.stability"} <= set(keel_modules)


def test_importing_keel_alone_loads_nothing_else():
    modules = loaded_after("import keel")
    assert [m for m in modules if m.split(".")[0] in ("keel", *ENGINE)] == ["keel"]


def test_every_init_kind_is_one_name_in_both_tables():
    """The config's descriptions and the model's draws hold the same init kinds; each builds and is described."""
    assert list(INITS) == list(INIT_FUNCTIONS)
    for kind in INITS:
        cfg = ModelConfig(init=kind, depth=2, width=32, n_heads=2, vocab_size=64, seq_len=8)
        KeelLM(cfg)
        assert init_description(cfg).startswith(f"{kind} (model.init={kind}): ")
    with pytest.raises(ConfigError, match="^model.init: unknown init 'nope'; allowed: auto, " + ", ".join(INITS)):
        ModelConfig(init="nope")


def test_the_engine_maps_every_name_the_config_validates():
    assert list(sources.SOURCES) == list(SOURCES)
    assert all(source.name == name for name, source in sources.SOURCES.items())
    assert list(LOGGERS) == list(keel.config.trainer.LOGGERS)


def test_each_callback_is_named_by_one_options_class():
    """Each options module of keel.callbacks.options defines one options class, and its `callback` is a class of
    keel.callbacks with a from_config; every such class is named by one of them."""
    options = [*CALLBACKS, EvalConfig]
    modules = Path(keel.callbacks.options.__path__[0]).glob("[!_]*.py")
    assert sorted(o.__module__ for o in options) == sorted(f"keel.callbacks.options.{m.stem}" for m in modules)
    built = set()
    for path in Path(keel.callbacks.__path__[0]).glob("*.py"):
        classes = [node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)]
        built |= {
            f"keel.callbacks.{path.stem}.{c.name}"
            for c in classes
            if any(isinstance(f, ast.FunctionDef) and f.name == "from_config" for f in c.body)
        }
    assert sorted(o.callback for o in options) == sorted(built)


def test_the_downstream_eval_callback_is_imported_only_when_built():
    """lm-eval loads slowly: its options name the callback without importing it."""
    modules = loaded_after(
        "from keel.config import load_config\nfrom keel.training import configured_callbacks\n"
        "configured_callbacks(load_config(overrides=['eval.enabled=false']))"
    )
    assert "keel.callbacks.throughput" in modules  # (built)
    assert "keel.callbacks.downstream_eval" not in modules and "lm_eval" not in modules


NEW_OPTIONS = """
from dataclasses import dataclass

from keel.callbacks.options import CallbackConfig
from keel.errors import require


@dataclass
class StepEchoConfig(CallbackConfig):
    name = "step_echo"
    priority = 25
    callback = "keel.callbacks.step_echo.StepEcho"

    every_n_steps: int = 5

    def __post_init__(self) -> None:
        require(self.every_n_steps >= 1, self.key("every_n_steps"), "must be >= 1")
"""
NEW_CALLBACK = """
from lightning.pytorch.callbacks import Callback


class StepEcho(Callback):
    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps

    @classmethod
    def from_config(cls, options, cfg):
        return cls(options.every_n_steps)
"""


def test_a_new_callback_is_two_files(tmp_path):
    """Its options module and its module, each put in its package's folder, and nothing else: the config takes its
    keys (and checks them), and a run builds it in its priority's place."""
    (tmp_path / "options").mkdir()
    (tmp_path / "options" / "step_echo.py").write_text(NEW_OPTIONS)
    (tmp_path / "step_echo.py").write_text(NEW_CALLBACK)
    script = textwrap.dedent(f"""
        import keel.callbacks, keel.callbacks.options
        keel.callbacks.__path__.append({str(tmp_path)!r})
        keel.callbacks.options.__path__.append({str(tmp_path / "options")!r})
        import json
        from keel.config import load_config, to_dict
        from keel.errors import ConfigError
        from keel.training import configured_callbacks
        cfg = load_config(overrides=["callbacks.step_echo.every_n_steps=3", "eval.enabled=false"])
        try:
            load_config(overrides=["callbacks.step_echo.every_n_steps=0"])
        except ConfigError as err:
            refused = str(err)
        print(json.dumps({{"saved": to_dict(cfg)["callbacks"]["step_echo"], "refused": refused,
                          "built": [type(cb).__name__ for cb in configured_callbacks(cfg)],
                          "every": configured_callbacks(cfg)[2].every_n_steps}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == {
        "saved": {"enabled": True, "every_n_steps": 3},
        "refused": "callbacks.step_echo.every_n_steps: must be >= 1",
        "built": ["GradNormMonitor", "StabilityMonitor", "StepEcho", "LayerImportance", "ThroughputMonitor"],
        "every": 3,
    }


def test_each_source_has_its_own_section():
    """data.<source>.* holds a source's keys; only the selected source's section is held to its own checks."""
    cfg = load_config(overrides=["data=text_files", "data.text_files.paths=[a/*.txt]", "data.hf.dataset=x/y"])
    assert cfg.data.source_config is cfg.data.text_files and cfg.data.text_files.paths == ["a/*.txt"]
    assert cfg.data.hf.dataset == "x/y"
    assert load_config(overrides=["data.source=hf"]).data.source_config.name == "sample-10BT"
    with pytest.raises(ConfigError, match="^data.text_files.paths: data.source=text_files needs at least one glob"):
        DataConfig(source="text_files")
    assert DataConfig(source="stdlib", text_files=TextFilesConfig()).source == "stdlib"


def test_a_key_that_moved_into_its_sources_section_is_refused_naming_its_new_key():
    valid = set(_valid_keys(Config()))
    for old in MOVED_KEYS:
        new = new_spelling(old)
        assert f"data.{old}" not in valid and set(new.split(" or ")) <= valid
        with pytest.raises(ConfigError, match=f"^data.{old}: moved into its source's section: use {new}$"):
            load_config(overrides=[f"data.{old}=x"])


def test_a_config_saved_before_the_sections_is_read_in_todays_spelling():
    """Checkpoints and run dirs keep the config they were made with: their flat data.* keys land in the sections."""
    saved = to_dict(load_config(overrides=["data=text_files", "data.text_files.paths=[a/*.txt]"]))
    data = {key: value for key, value in saved["data"].items() if key not in SOURCES}
    data |= {
        "paths": ["b/*.txt"],
        "doc_chars": 7,
        "text_field": "body",
        "hf_dataset": "x/y",
        "hf_name": None,
        "hf_split": "test",
    }
    cfg = from_dict({**saved, "data": data})
    assert cfg.data.text_files == TextFilesConfig(paths=["b/*.txt"], text_field="body", doc_chars=7)
    assert (cfg.data.hf.dataset, cfg.data.hf.name, cfg.data.hf.split, cfg.data.hf.text_field) == (
        "x/y",
        None,
        "test",
        "body",
    )
    assert from_dict(saved) == load_config(overrides=["data=text_files", "data.text_files.paths=[a/*.txt]"])


def test_a_resume_of_a_config_saved_before_the_sections_reports_no_moved_key_as_a_change():
    """Resuming a run saved with the flat data.* keys said each moved key was a changed setting (13 of them)."""
    from keel.rundir import changed_keys  # (torch: after the torch-free checks above)

    cfg = load_config(overrides=["data=text_files", "data.text_files.paths=[a/*.txt]"])
    saved = to_dict(cfg)
    flat = {key: value for key, value in saved["data"].items() if key not in SOURCES}
    flat |= {old: saved["data"][section][new] for old, [(section, new), *_] in MOVED_KEYS.items()}
    saved = {**saved, "data": flat, "run": {key: value for key, value in saved["run"].items() if key != "overwrite"}}
    assert changed_keys(saved, cfg) == []
    assert changed_keys(saved, load_config(overrides=["data=text_files", "data.text_files.paths=[b/*.txt]"])) == [
        "data.text_files.paths: ['a/*.txt'] -> ['b/*.txt']"
    ]
