"""keel.config is the bottom of the import order: it loads no torch, no Lightning and nothing of the engine, and
every name it validates (init kinds, data sources, callbacks, loggers) is one the engine maps to its own code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import keel.config.trainer
from keel.callbacks.registry import BUILDERS
from keel.config import (
    CALLBACKS, SOURCES, Config, DataConfig, EvalConfig, ModelConfig, TextFilesConfig, from_dict, load_config, to_dict,
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
    assert [m for m in keel_modules if m not in ("keel", "keel.errors", "keel.conf")
            and not m.startswith("keel.config")] == []
    assert "keel.config.model" in keel_modules  # (the check above looked at what it should)


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
    assert set(BUILDERS) == {options.name for options in CALLBACKS} | {EvalConfig.name}
    assert list(LOGGERS) == list(keel.config.trainer.LOGGERS)


def test_the_downstream_eval_callback_is_imported_only_when_built():
    """lm-eval loads slowly: the callbacks' table names it without importing it."""
    modules = loaded_after("import keel.callbacks.registry")
    assert "keel.callbacks.downstream_eval" not in modules and "lm_eval" not in modules


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
    data |= {"paths": ["b/*.txt"], "doc_chars": 7, "text_field": "body", "hf_dataset": "x/y", "hf_name": None,
             "hf_split": "test"}
    cfg = from_dict({**saved, "data": data})
    assert cfg.data.text_files == TextFilesConfig(paths=["b/*.txt"], text_field="body", doc_chars=7)
    assert (cfg.data.hf.dataset, cfg.data.hf.name, cfg.data.hf.split, cfg.data.hf.text_field) == ("x/y", None, "test",
                                                                                                   "body")
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
        "data.text_files.paths: ['a/*.txt'] -> ['b/*.txt']"]
