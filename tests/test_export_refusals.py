"""What `keel export` and Keel reading an export refuse: what it cannot write, foreign, incomplete, damaged or
edited directories, untrusted configs checked against the weights, models too big for the machine; `--verify`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="keel export needs the hf extra: pip install 'keel[hf]'")

from keel.checkpoint.layout import LAST  # noqa: E402
from keel.checkpoint.read import load_model, read_checkpoint  # noqa: E402
from keel.cli import main as cli_main  # noqa: E402
from keel.errors import ConfigError  # noqa: E402
from keel.export import export, verify  # noqa: E402
from keel.model import KeelLM  # noqa: E402
from keel.training import train  # noqa: E402
from keeltest.export import random_checkpoint  # noqa: E402
from keeltest.runs import FOUR_STEP_RUN, tiny_config  # noqa: E402


def test_export_refuses_what_it_cannot_write(tiny_run, tokenizer_json, tmp_path, monkeypatch, capsys):
    source = tiny_run / "checkpoints" / LAST
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert cli_main(["export", f"checkpoint={source}", "--out", str(taken)]) == 2
    assert "not an empty directory" in capsys.readouterr().err and (taken / "notes.txt").read_text() == "mine"
    _, no_tokenizer = random_checkpoint([], tokenizer_json, tmp_path / "bare.ckpt")
    bare = torch.load(no_tokenizer, weights_only=True)
    bare["keel"]["tokenizer_json"] = None
    torch.save(bare, no_tokenizer)
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        export(str(no_tokenizer), tmp_path / "out")
    with pytest.raises(ConfigError, match="no file or directory"):
        export(str(tmp_path / "missing.ckpt"), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as without the hf extra
    with pytest.raises(ConfigError, match=r"pip install 'keel\[hf\]'"):
        export(str(source), tmp_path / "out")


def test_verify_measures_the_export_against_its_checkpoint(tiny_run, exported, tmp_path, capsys):
    source = tiny_run / "checkpoints" / LAST
    check = verify(str(source), exported)
    assert check["max_logit_difference"] < 1e-5 < check["max_logit"]
    assert check["greedy_tokens_equal"] == check["greedy_tokens"] >= 8
    # a directory whose weights were altered is told apart: one final-norm gain off by 10%
    from safetensors.torch import load_file, save_file

    altered = tmp_path / "altered"
    shutil.copytree(exported, altered)
    weights = load_file(altered / "model.safetensors")
    name = next(name for name in weights if name.endswith("norm_out.weight"))
    weights[name][0] *= 1.1
    save_file(weights, altered / "model.safetensors", metadata={"format": "pt"})
    assert verify(str(source), altered)["max_logit_difference"] > 1e-3
    assert cli_main(["export", f"checkpoint={source}", "--out", str(tmp_path / "cli"), "--verify"]) == 0
    assert f"greedy decoding equal for {check['greedy_tokens']} of {check['greedy_tokens']} tokens" in (
        capsys.readouterr().out
    )


def test_keel_never_runs_an_exports_code(tiny_run, exported, tmp_path, capsys):
    """Keel reads config.json, tokenizer.json and the safetensors of an export; the Python files are transformers'
    business (trust_remote_code), so a directory whose code was replaced is read without running it."""
    hostile, marker = tmp_path / "hostile", tmp_path / "code-ran"
    shutil.copytree(exported, hostile)
    for name in ("modeling_keel.py", "configuration_keel.py"):
        (hostile / name).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert cli_main(["generate", f"checkpoint={hostile}", "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert read_checkpoint(hostile)["state_dict"] and not marker.exists()


def test_keel_refuses_foreign_and_incomplete_model_directories(exported, tmp_path):
    foreign = tmp_path / "llama"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="did not write .model_type 'llama'"):
        read_checkpoint(foreign)
    incomplete = tmp_path / "incomplete"
    shutil.copytree(exported, incomplete)
    (incomplete / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"incomplete export \(no model.safetensors\)"):
        load_model(incomplete)
    assert read_checkpoint(incomplete, weights=False)["keel"]["config"]["model"]["depth"] == 2


# Peak RSS from VmHWM: ru_maxrss would count the forking pytest process's own memory (it survives exec)
PEAK_RSS = """
import re, sys
from keel import cli
code = cli.main(sys.argv[1:])
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024, file=sys.stderr)
sys.exit(code)
"""


def with_config(source: Path, out: Path, **model) -> Path:
    """A copy of a checkpoint file or an export whose recorded Keel config says other model.* values."""
    if source.is_dir():
        shutil.copytree(source, out)
        config = json.loads((out / "config.json").read_text())
        config["keel"]["model"].update(model)
        (out / "config.json").write_text(json.dumps(config))
    else:
        checkpoint = torch.load(source, weights_only=True)
        checkpoint["keel"]["config"]["model"].update(model)
        torch.save(checkpoint, out)
    return out


def test_an_untrusted_config_is_checked_against_the_weights_before_any_model_is_built(
    tiny_run, exported, tmp_path, capsys
):
    """A checkpoint or export whose config says depth 1,000,000 over 2 blocks of weights ran `keel generate`
    out of memory (it built KeelLM(cfg.model) first): every loader now refuses it in one line, and a consistent model
    too big for this machine is refused with its estimate, before it is built."""
    source = tiny_run / "checkpoints" / LAST
    edited = [
        with_config(source, tmp_path / "deep.ckpt", depth=1_000_000),
        with_config(exported, tmp_path / "deep-hf", depth=1_000_000),
    ]
    for path in edited:
        said = f"checkpoint: {path}: its config says model.depth=1000000, its weights hold 2 blocks"
        for argv in (
            ["generate", f"checkpoint={path}"],
            ["export", str(path), "--out", str(tmp_path / "out")],
            ["gradflow", "--checkpoint", str(path)],
            ["redundancy", str(path), "--out", str(tmp_path / "r")],
            ["eval", "--model_args", f"checkpoint={path}", "--tasks", "keel_next_line", "--device", "cpu"],
        ):
            assert cli_main(argv) == 2, argv
            err = capsys.readouterr().err.splitlines()
            assert err[-1].startswith(f"keel {argv[0]}: config error: {said}"), (argv, err)
        assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()
    wide = with_config(exported, tmp_path / "wide-hf", width=64)
    with pytest.raises(
        ConfigError,
        match=r"its weights do not match its model config \(shapes embed.weight "
        r"\(512, 32\) \(config: \(512, 64\)\)",
    ):
        load_model(wide)
    # in a process of its own: refused before anything of the config's size is allocated
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, "generate", f"checkpoint={edited[1]}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "its config says model.depth=1000000" in done.stderr
    assert int(done.stderr.splitlines()[-1]) < 2**31  # 2 GiB


def test_a_model_too_big_for_this_machine_is_refused_with_its_estimate_before_it_is_built(
    tiny_run, monkeypatch, capsys
):
    monkeypatch.setattr("keel.memory.available_bytes", lambda: 1000)
    built = []
    monkeypatch.setattr(KeelLM, "__init__", lambda *args: built.append(args))
    source = tiny_run / "checkpoints" / LAST
    assert cli_main(["generate", f"checkpoint={source}"]) == 2
    assert re.fullmatch(
        rf"keel generate: config error: checkpoint: {re.escape(str(source))}: its model "
        r"\(model.depth=2, model.width=32, model.seq_len=32\) needs about 0.0 GiB \([\d,]+ parameters: "
        r"fp32 weights; plus activations\), more than the 0.0 GiB available here; use a machine with "
        r"more memory",
        capsys.readouterr().err.strip(),
    )
    assert not built


def test_a_damaged_or_edited_export_is_refused_in_one_line(tiny_data, exported, tmp_path, capsys):
    """SafetensorError, JSONDecodeError, StopIteration and load_state_dict's RuntimeError were tracebacks; a
    weight_map naming a file outside the directory was read."""
    from safetensors.torch import load_file, save_file

    def damaged(name: str, damage) -> Path:
        copy = tmp_path / name
        shutil.copytree(exported, copy)
        damage(copy)
        return copy

    weights = load_file(exported / "model.safetensors")
    outside = tmp_path / "elsewhere.safetensors"
    save_file(weights, outside)
    index = {"weight_map": {name: f"../{outside.name}" for name in weights}}
    renamed = {("model.extra." + name if name.startswith("lm_head") else name): t for name, t in weights.items()}
    narrowed = {
        name: (t[:, :16].contiguous() if name.endswith("embed_tokens.weight") else t) for name, t in weights.items()
    }
    cases = {
        "truncated": (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
            r"model.safetensors cannot be read \(corrupt or truncated\?\): ",
        ),
        "bad-json": (
            lambda d: (d / "config.json").write_text('{"model_type": "keel", "ke'),
            r"config.json cannot be read \(corrupt or truncated\?\): ",
        ),
        "listed": (
            lambda d: (d / "config.json").write_text("[1, 2]"),
            r"config.json holds a list, not the JSON object an export writes",
        ),
        "outside": (
            lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(index)),
            r"model.safetensors.index.json refused: its weight_map must name weight files in .* itself",
        ),
        "renamed": (
            lambda d: save_file(renamed, d / "model.safetensors"),
            r"holds weights a keel export never has \(model.extra.lm_head.weight\)",
        ),
        "narrowed": (
            lambda d: save_file(narrowed, d / "model.safetensors"),
            r"its weights do not match its model config \(shapes embed.weight \(512, 16\)",
        ),
    }
    for name, (damage, said) in cases.items():
        path = damaged(name, damage)
        assert cli_main(["generate", f"checkpoint={path}"]) == 2, name
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and re.match(
            f"keel generate: config error: checkpoint: {tmp_path}/{name}.*{said}", err[0]
        ), (name, err)
    with pytest.raises(ConfigError, match=rf"init_from: {tmp_path}/narrowed: its weights do not match"):
        train(tiny_config(tiny_data, tmp_path / "run", *FOUR_STEP_RUN, f"init_from={tmp_path / 'narrowed'}"))
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    assert cli_main(["export", str(exported), "--out", str(blocker / "hf")]) == 2  # was FileExistsError
    assert capsys.readouterr().err == (
        f"keel export: config error: export: cannot write {blocker / 'hf'}: {blocker} "
        "is a file, not a directory; choose another --out\n"
    )
