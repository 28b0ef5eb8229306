"""`keel export`'s directory: it loads offline with its tokenizer, its model card states the run's facts and no
machine path, transformers 4 is refused in one line, bf16 and sharded weights round-trip, and Keel reads it back."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers", reason="keel export needs the hf extra: pip install 'keel[hf]'")

from keel.checkpoint.layout import LAST  # noqa: E402
from keel.checkpoint.payload import read_payload  # noqa: E402
from keel.checkpoint.read import load_model, read_checkpoint  # noqa: E402
from keel.cli import main as cli_main  # noqa: E402
from keel.config import to_dict  # noqa: E402
from keel.config.model import formulas  # noqa: E402
from keel.data.tokenizer import eos_id_of  # noqa: E402
from keel.errors import ConfigError  # noqa: E402
from keel.evaluation.generated import load_next_line  # noqa: E402
from keel.export import export  # noqa: E402
from keel.model import next_token_loss  # noqa: E402
from keel.training import train  # noqa: E402
from keeltest import write_sharded  # noqa: E402
from keeltest.export import VOCAB, hf_model, load_hf, standalone  # noqa: E402
from keeltest.runs import FOUR_STEP_RUN, FirstBatch, scalars, tiny_config  # noqa: E402


def test_the_directory_loads_offline_and_its_tokenizer_encodes_as_keel_does(exported, tiny_run):
    names = {path.name for path in exported.iterdir()}
    assert {
        "config.json",
        "configuration_keel.py",
        "modeling_keel.py",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_keel.KeelConfig",
        "AutoModel": "modeling_keel.KeelModel",
        "AutoModelForCausalLM": "modeling_keel.KeelForCausalLM",
    }
    # the remote code is self-contained: it imports torch, transformers and itself only
    for name in ("configuration_keel.py", "modeling_keel.py"):
        tree = ast.parse((exported / name).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
        assert {module.split(".")[0] for module in imported} <= {"__future__", "torch", "transformers"}
    _, cfg, tokenizer_json = load_model(tiny_run / "checkpoints" / LAST)
    assert config["keel"]["model"] == to_dict(cfg)["model"]
    assert config["keel"]["run"]["dir"] == "run" and config["keel"]["data"]["dir"] == Path(cfg.data.dir).name
    keel_tokenizer = Tokenizer.from_str(tokenizer_json)
    eos = eos_id_of(keel_tokenizer)
    _, tokenizer = load_hf(exported)
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == eos
    text = "def main(argv):\n    return 0\n"
    plain = keel_tokenizer.encode(text, add_special_tokens=False).ids  # as the shards and `--model keel` encode
    assert tokenizer(text).input_ids == tokenizer(text, add_special_tokens=False).input_ids == plain
    assert tokenizer(tokenizer.eos_token + text).input_ids == [eos, *plain]  # a document's start, as in training


MODEL_CARD = """
    import json
    from huggingface_hub import ModelCard

    card = ModelCard.load(sys.argv[1])
    print(json.dumps({"metadata": card.data.to_dict(), "text": card.text}))
"""


def test_the_model_card_renders_the_runs_facts_and_no_file_names_a_machine_path(exported, tiny_run, tmp_path_factory):
    card = json.loads(standalone(MODEL_CARD, exported / "README.md").stdout)  # as the hub reads it
    assert {key: card["metadata"].get(key) for key in ("license", "library_name", "pipeline_tag")} == {
        "license": "other",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
    }
    _, cfg, _ = load_model(tiny_run / "checkpoints" / LAST)
    heldout = scalars(tiny_run, "val/loss")
    text = card["text"]
    assert f"scheme `{cfg.model.scheme}`" in text and "trust_remote_code=True" in text and "## Intended use" in text
    assert all(f"- `{formula}`: {count} sublayers" in text for formula, count in formulas(cfg.model))
    assert f"30 optimizer steps of {cfg.device_tokens_per_step:,} tokens" in text
    assert f"Held-out loss: {heldout[max(heldout)]:.4f} nats per token at step 30" in text
    assert "the Python standard library's source files" not in text  # the tiny run's data: text files
    machine = [str(tmp_path_factory.getbasetemp()), str(Path.home())]  # where the run, data and corpus live
    for path in exported.iterdir():
        content = path.read_bytes()
        assert not [place for place in machine if place.encode() in content], path.name


def test_an_export_keeps_the_held_out_loss_for_the_model_card_of_its_export(tiny_run, exported, tmp_path):
    """An export carries the checkpoint's payload, held-out loss included: exported again (an export reads as a
    checkpoint), it writes the same model card."""
    source = read_payload(read_checkpoint(tiny_run / "checkpoints" / LAST, weights=False))
    assert source.heldout is not None and source.heldout["step"] == 30
    assert read_payload(read_checkpoint(exported, weights=False)).heldout == source.heldout
    again = export(str(exported), tmp_path / "again")
    assert (again / "README.md").read_text() == (exported / "README.md").read_text()


TRANSFORMERS_4 = """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, text = sys.argv[1:3]
    print(transformers.__version__, AutoTokenizer.from_pretrained(directory).encode(text))
    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
"""


@pytest.mark.extended
@pytest.mark.slow
def test_transformers_4_loads_the_tokenizer_and_refuses_the_model_in_one_line(exported, tokenizer_json, tmp_path):
    """transformers 4.57 (the last 4.x) installed beside this environment's torch, from PyPI."""
    target = tmp_path / "transformers4"
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            "transformers==4.57.6",
            "tokenizers>=0.22,<0.23",
            "huggingface_hub>=0.34,<1.0",
        ],
        capture_output=True,
        text=True,
    )
    if installed.returncode:
        pytest.skip(f"cannot install transformers 4.57 here: {installed.stderr.strip()[-300:]}")
    text = "def main(argv):\n    return 0\n"
    done = standalone(TRANSFORMERS_4, exported, text, pythonpath=target, check=False)
    version, ids = done.stdout.split(" ", 1)
    assert version == "4.57.6" and json.loads(ids) == Tokenizer.from_str(tokenizer_json).encode(text).ids
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        "ImportError: transformers>=5.24 is required for a normal functioning of this module, but found "
        "transformers==4.57.6."
    )


def test_bf16_sharded_export_and_the_save_load_round_trip(tiny_run, exported, tmp_path):
    source = tiny_run / "checkpoints" / LAST
    model = hf_model(exported)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp32 = model(ids).logits
        # save_pretrained / from_pretrained keep the model as it is
        model.save_pretrained(tmp_path / "saved")
        torch.testing.assert_close(hf_model(tmp_path / "saved")(ids).logits, fp32, rtol=0, atol=0)
        # an FSDP sharded checkpoint exports the same weights, here in shards of at most 100 kB with an index
        sharded = write_sharded(source, tmp_path / "sharded.ckpt")
        export(str(sharded), tmp_path / "split", max_shard_size="100KB")
        index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        torch.testing.assert_close(hf_model(tmp_path / "split")(ids).logits, fp32, rtol=0, atol=0)
        # bf16: matrices in bf16, the norms' gains kept in fp32 (they compound over depth)
        export(str(source), tmp_path / "bf16", dtype="bf16")
        bf16 = hf_model(tmp_path / "bf16")
        dtypes = {name: param.dtype for name, param in bf16.named_parameters()}
        assert {dtype for name, dtype in dtypes.items() if "norm" in name} == {torch.float32}
        assert {dtype for name, dtype in dtypes.items() if "norm" not in name} == {torch.bfloat16}
        logits = bf16(ids).logits.float()
        # so does an fp32 export loaded in bf16
        cast = {
            (("norm" in name), param.dtype)
            for name, param in hf_model(exported, dtype=torch.bfloat16).named_parameters()
        }
        assert cast == {(True, torch.float32), (False, torch.bfloat16)}
    assert (logits - fp32).abs().max() < 0.1 * fp32.abs().max()
    assert (logits.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.9


def test_keel_reads_an_export_back(tiny_data, tiny_run, exported, tmp_path, capsys):
    source = tiny_run / "checkpoints" / LAST
    # init_from=DIR: the first step's loss is the source checkpoint's on that batch
    run, first = tmp_path / "continued", FirstBatch()
    train(tiny_config(tiny_data, run, *FOUR_STEP_RUN, f"init_from={exported}"), extra_callbacks=[first])
    model, _, _ = load_model(source)
    with torch.no_grad():
        expected = next_token_loss(model, first.batch).item()
    assert scalars(run, "train/loss")[0] == pytest.approx(expected, rel=1e-6)
    # the weights Keel reads from it are the checkpoint's, and it cannot be resumed (no optimizer state)
    back, source_state = read_checkpoint(exported), read_checkpoint(source)
    assert back["state_dict"].keys() == source_state["state_dict"].keys()
    assert all(torch.equal(back["state_dict"][k], v) for k, v in source_state["state_dict"].items())
    # keel generate (and keel eval, through the same load_model) read it as they read the checkpoint
    options = ["--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    texts, _ = [], capsys.readouterr()  # (the training run's output)
    for path in (source, exported):
        assert cli_main(["generate", f"checkpoint={path}", *options]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("def \n")
    with pytest.raises(ConfigError, match="exported model.*init_from="):
        train(tiny_config(tiny_data, tmp_path / "resumed", *FOUR_STEP_RUN, f"resume={exported}"))


def test_the_generated_tasks_of_an_export_say_what_to_pass(tiny_data, exported):
    """An export records data.dir cut to its last part (no machine paths): evaluating it on the generated tasks
    asks for --metadata corpus_dir (it advised `keel data`), and with it reads the tasks the checkpoint's data.dir
    holds."""
    data_dir = next(o.split("=", 1)[1] for o in tiny_data if o.startswith("data.dir="))
    with pytest.raises(FileNotFoundError, match=r"exported model.*--metadata '\{\"corpus_dir\": \"DIR\"\}'"):
        load_next_line(checkpoint=str(exported))
    assert load_next_line(checkpoint=str(exported), corpus_dir=data_dir)["test"].num_rows > 0
