"""`keel export`: the Hugging Face directory against the Keel model it came from (every scheme's logits, loss, KV
cache and padding; greedy decoding; bf16; sharded weights; the save/load round trip), Keel reading it back
(init_from, eval, generate), lm-eval's `hf` model scoring it like `--model keel`, TRL fine-tuning it, and the
refusals."""

from __future__ import annotations

import ast
import re
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers", reason="keel export needs the hf extra: pip install 'keel[hf]'")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from keel.checkpoint import LAST, load_model, read_checkpoint  # noqa: E402
from keel.cli import main as cli_main  # noqa: E402
from keel.config import load_config, to_dict  # noqa: E402
from keel.data.shards import VAL_DOCS  # noqa: E402
from keel.data.tokenizer import eos_id_of  # noqa: E402
from keel.decoding import generate  # noqa: E402
from keel.errors import ConfigError  # noqa: E402
from keel.evaluation.generated import generate_tasks  # noqa: E402
from keel.export import export, verify  # noqa: E402
from keel.model import KeelLM, next_token_loss  # noqa: E402
from keel.schemes import formulas  # noqa: E402
from keel.training import train  # noqa: E402

from conftest import write_sharded  # noqa: E402
from test_init_from import STEPS, FirstBatch  # noqa: E402
from test_pretrain import scalars, tiny_config  # noqa: E402

VOCAB = 512
BASE = ["model.depth=3", "model.width=32", "model.n_heads=4", "model.seq_len=24", f"model.vocab_size={VOCAB}"]
# Every scheme and every option that changes the computation (docs/schemes.md)
VARIANTS = {
    "keel": [],
    "keel-v2-alpha-swiglu-gqa": ["model.keel_first_block=v2", "model.keel_alpha=5", "model.ffn=swiglu",
                                 "model.n_kv_heads=2"],
    "keel-no-inner-norm": ["model.keel_inner_norm=false"],
    "keel-no-gain-tied": ["model.out_norm_gain=false", "model.tie_embeddings=true"],
    "preln": ["model.scheme=preln"],
    "postln": ["model.scheme=postln"],
    "postln-final-norm": ["model.scheme=postln", "model.postln_final_norm=true"],
    "deepnorm": ["model.scheme=deepnorm"],
    "hybridnorm": ["model.scheme=hybridnorm"],
    "hybridnorm_star": ["model.scheme=hybridnorm_star", "model.rope_theta=500"],
    "mixln": ["model.scheme=mixln", "model.depth=4", "model.mixln_post_fraction=0.5"],
    # muP at a width (32) other than its base: logits multiplier 0.5, attention scale sqrt(16/4)/8
    "keel-mup": ["model.parametrization=mup", "model.mup_base_width=16"],
    "preln-mup-tied": ["model.scheme=preln", "model.parametrization=mup", "model.mup_base_width=64",
                       "model.tie_embeddings=true"],
}


def standalone(script: str, *args, pythonpath: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run script (python -c, its args in sys.argv[1:]) in a fresh interpreter where keel cannot be imported, as
    a user of the export has it: the exported directory must stand alone. pythonpath: packages to use before this
    environment's; check: that it succeeds."""
    prelude = "import sys\nsys.modules['keel'] = None  # any import of keel fails\n"
    env = os.environ if pythonpath is None else {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 or not check, done.stderr[-4000:]
    return done


def hf_model(directory: Path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **kwargs).eval()


def load_hf(directory: Path):
    return hf_model(directory), AutoTokenizer.from_pretrained(directory, trust_remote_code=True)


@pytest.fixture(scope="module")
def tokenizer_json(tiny_data) -> str:
    data_dir = next(o.split("=", 1)[1] for o in tiny_data if o.startswith("data.dir="))
    return (Path(data_dir) / "tokenizer.json").read_text()


def random_checkpoint(overrides: list[str], tokenizer_json: str, path: Path) -> tuple[KeelLM, Path]:
    """A KeelLM with every parameter moved off its init (norm gains included: a wrong mapping shows), saved as
    a checkpoint the way training saves one."""
    cfg = load_config(overrides=[*BASE, *overrides])
    torch.manual_seed(0)
    model = KeelLM(cfg.model).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    torch.save({"keel": {"config": to_dict(cfg), "tokenizer_json": tokenizer_json}, "state_dict": state,
                "global_step": 7}, path)
    return model, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_export_computes_what_keel_computes(variant, tokenizer_json, tmp_path):
    model, checkpoint = random_checkpoint(VARIANTS[variant], tokenizer_json, tmp_path / "model.ckpt")
    hf = hf_model(export(str(checkpoint), tmp_path / "hf"))
    assert hf.config.scheme == model.cfg.scheme and hf.config.trained_steps == 7
    assert hf.config.logits_multiplier == model.cfg.mup_ratio  # 1 under sp; muP's readout multiplier under mup
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
        torch.testing.assert_close(hf(ids).logits, expected, rtol=0, atol=1e-5)
        # labels= is next_token_loss (the labels are shifted inside)
        assert hf(ids, labels=ids).loss.item() == pytest.approx(next_token_loss(model, ids).item(), rel=1e-6)
        # the KV cache: 12 tokens, then 8 more one call later
        prefix = hf(ids[:, :12], use_cache=True)
        rest = hf(ids[:, 12:], cache=prefix.cache, use_cache=True).logits
        torch.testing.assert_close(torch.cat((prefix.logits, rest), dim=1), expected, rtol=0, atol=1e-5)
        if variant == "keel":  # the argument's name before transformers 5.2x, still accepted
            prefix = hf(ids[:, :12], use_cache=True)
            rest = hf(ids[:, 12:], past_key_values=prefix.cache, use_cache=True).logits
            torch.testing.assert_close(rest, expected[:, 12:], rtol=0, atol=1e-5)
        # left padding with an attention mask: each row's logits as without the padding
        pad = 5
        padded = torch.cat((torch.zeros(3, pad, dtype=torch.long), ids[:, :15]), dim=1)
        mask = torch.ones_like(padded)
        mask[1:, :pad] = 0  # rows 1 and 2 padded, row 0 a real 20-token sequence
        logits = hf(padded, attention_mask=mask).logits
        torch.testing.assert_close(logits[1:, pad:], model(ids[1:, :15]), rtol=0, atol=1e-5)
        torch.testing.assert_close(logits[0], model(padded[:1])[0], rtol=0, atol=1e-5)


PACKED_FORWARD = """
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    directory, work = sys.argv[1:3]
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    # TRL's packing (bfd) collates padding-free: one row, position_ids restarting at 0, cu_seq_lens, no mask
    collator = DataCollatorForLanguageModeling(pad_token_id=model.config.pad_token_id, padding_free=True)
    batch = collator([{"input_ids": ids} for ids in torch.load(f"{work}/examples.pt")])
    assert "attention_mask" not in batch and "cu_seq_lens_q" in batch
    model.train()
    with torch.no_grad():
        out = model(**batch, use_cache=False)  # as SFTTrainer.compute_loss calls it
    torch.save({"position_ids": batch["position_ids"], "logits": out.logits, "loss": out.loss}, f"{work}/packed.pt")
"""


def test_packed_sequences_from_trls_collator_are_each_computed_alone(tokenizer_json, tmp_path):
    """TRL's padding-free packing: every example's logits are its logits alone, and the loss is theirs."""
    model, checkpoint = random_checkpoint(VARIANTS["keel-v2-alpha-swiglu-gqa"], tokenizer_json, tmp_path / "m.ckpt")
    directory = export(str(checkpoint), tmp_path / "hf")
    generator = torch.Generator().manual_seed(3)
    examples = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (9, 5, 12)]
    torch.save(examples, tmp_path / "examples.pt")
    standalone(PACKED_FORWARD, directory, tmp_path)
    packed = torch.load(tmp_path / "packed.pt")
    assert packed["position_ids"][0].tolist() == [i for ids in examples for i in range(len(ids))]
    with torch.no_grad():
        alone = [model(torch.tensor([ids]))[0] for ids in examples]
        torch.testing.assert_close(packed["logits"][0], torch.cat(alone), rtol=0, atol=1e-5)
        # labels: each example's tokens after its first, as unpacked
        losses = [next_token_loss(model, torch.tensor([ids])) * (len(ids) - 1) for ids in examples]
    assert packed["loss"].item() == pytest.approx(sum(losses).item() / sum(len(ids) - 1 for ids in examples),
                                                  rel=1e-5)


LOOK_INSIDE = """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    directory, work = sys.argv[1:3]
    ids, mask = torch.load(f"{work}/inputs.pt")
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    eager = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, attn_implementation="eager")
    base = AutoModel.from_pretrained(directory, trust_remote_code=True)
    assert eager.config._attn_implementation == "eager"
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        # the logit lens: each block's stream through the final norm and the head (the last is normed already)
        norm = model.model.norm or torch.nn.Identity()
        lens = [model.lm_head(norm(h)) for h in hidden[:-1]] + [model.lm_head(hidden[-1])]
        seen = eager(ids, attention_mask=mask, output_attentions=True)
        prompt = ids[:1, :4]
        greedy = {cache: model.generate(prompt, max_new_tokens=8, do_sample=False, cache_implementation=cache)[0]
                  for cache in ("dynamic", "static")}
        torch.save({"hidden": hidden, "lens": torch.stack(lens), "eager_logits": seen.logits,
                    "attentions": seen.attentions, "base": base(ids).last_hidden_state, "base_class": type(base).__name__,
                    "greedy": greedy}, f"{work}/inside.pt")
"""


def test_hidden_states_attentions_base_model_and_static_cache_as_llamas(tokenizer_json, tmp_path):
    """output_hidden_states (a logit lens over them), output_attentions under attn_implementation="eager",
    AutoModel, and generate(cache_implementation="static"), standalone, against Keel's model."""
    model, checkpoint = random_checkpoint(["model.scheme=hybridnorm", "model.n_kv_heads=2"], tokenizer_json,
                                          tmp_path / "m.ckpt")
    directory = export(str(checkpoint), tmp_path / "hf")
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded by 3
    torch.save((ids, mask), tmp_path / "inputs.pt")
    standalone(LOOK_INSIDE, directory, tmp_path)
    inside = torch.load(tmp_path / "inside.pt")
    streams = []  # Keel's: the embedding's output and each block's
    hooks = [module.register_forward_hook(lambda _, args, out: streams.append(out.float()))
             for module in (model.embed, *model.blocks)]
    with torch.no_grad():
        logits = model(ids)
        for hook in hooks:
            hook.remove()
        final = model.final_norm(streams[-1])
        expected = [*streams[:-1], final]
        lens = torch.stack([model.head(model.final_norm(h)) for h in streams])
        unpadded = model(ids[1:, 3:])
    assert len(inside["hidden"]) == model.cfg.depth + 1
    for got, want in zip(inside["hidden"], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(inside["lens"], lens, rtol=0, atol=1e-4)
    torch.testing.assert_close(inside["lens"][-1], logits, rtol=0, atol=1e-5)
    # eager attention computes the same model, and its weights are causal distributions over the real tokens
    torch.testing.assert_close(inside["eager_logits"][0], logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(inside["eager_logits"][1, 3:], unpadded[0], rtol=0, atol=1e-5)
    assert len(inside["attentions"]) == model.cfg.depth
    future = torch.ones(12, 12, dtype=torch.bool).triu(1)  # (query, key): the keys after the query
    for weights in inside["attentions"]:  # (B, H, query, key); row 1's first 3 queries are padding
        assert weights.shape == (2, model.cfg.n_heads, 12, 12)
        torch.testing.assert_close(weights.sum(-1)[1, :, 3:], torch.ones(model.cfg.n_heads, 9))
        assert not weights[0][:, future].any() and not weights[1, :, 3:][:, future[3:]].any()
        assert not weights[1, :, 3:, :3].any()  # nor the padding
    assert inside["base_class"] == "KeelModel"
    torch.testing.assert_close(inside["base"], final, rtol=0, atol=1e-5)
    keel_greedy = generate(model, ids[:1, :4], 8, stop_tokens=(eos_id_of(Tokenizer.from_str(tokenizer_json)),))[0]
    assert inside["greedy"]["static"].tolist() == inside["greedy"]["dynamic"].tolist() == keel_greedy.tolist()


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    assert cli_main(["export", f"checkpoint={tiny_run / 'checkpoints' / LAST}", "--out", str(out)]) == 0
    return out


def test_the_directory_loads_offline_and_its_tokenizer_encodes_as_keel_does(exported, tiny_run):
    names = {path.name for path in exported.iterdir()}
    assert {"config.json", "configuration_keel.py", "modeling_keel.py", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json"} <= names
    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_keel.KeelConfig", "AutoModel": "modeling_keel.KeelModel",
                                  "AutoModelForCausalLM": "modeling_keel.KeelForCausalLM"}
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


def test_the_model_card_renders_the_runs_facts_and_no_file_names_a_machine_path(exported, tiny_run,
                                                                                 tmp_path_factory):
    card = json.loads(standalone(MODEL_CARD, exported / "README.md").stdout)  # as the hub reads it
    assert {key: card["metadata"].get(key) for key in ("license", "library_name", "pipeline_tag")} == {
        "license": "other", "library_name": "transformers", "pipeline_tag": "text-generation"}
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
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                                str(target), "transformers==4.57.6", "tokenizers>=0.22,<0.23",
                                "huggingface_hub>=0.34,<1.0"], capture_output=True, text=True)
    if installed.returncode:
        pytest.skip(f"cannot install transformers 4.57 here: {installed.stderr.strip()[-300:]}")
    text = "def main(argv):\n    return 0\n"
    done = standalone(TRANSFORMERS_4, exported, text, pythonpath=target, check=False)
    version, ids = done.stdout.split(" ", 1)
    assert version == "4.57.6" and json.loads(ids) == Tokenizer.from_str(tokenizer_json).encode(text).ids
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        "ImportError: transformers>=5.24 is required for a normal functioning of this module, but found "
        "transformers==4.57.6.")


def test_greedy_generate_is_keel_generate(exported, tiny_run, capsys):
    prompt = "def "
    assert cli_main(["generate", f"checkpoint={tiny_run / 'checkpoints' / LAST}", "--prompt", prompt,
                     "--max-new-tokens", "20", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    model, tokenizer = load_hf(exported)
    inputs = tokenizer(tokenizer.eos_token + prompt, return_tensors="pt")  # EOS first, as keel generate puts it
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new = out[0, inputs.input_ids.shape[1]:].tolist()
    assert len(new) >= 8  # a real continuation
    text = tokenizer.decode(new, skip_special_tokens=True)  # keel generate stops at EOS and does not print it
    assert printed == prompt + text + "\n"


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
        cast = {(("norm" in name), param.dtype) for name, param in hf_model(exported, dtype=torch.bfloat16)
                .named_parameters()}
        assert cast == {(True, torch.float32), (False, torch.bfloat16)}
    assert (logits - fp32).abs().max() < 0.1 * fp32.abs().max()
    assert (logits.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.9


def test_keel_reads_an_export_back(tiny_data, tiny_run, exported, tmp_path, capsys):
    source = tiny_run / "checkpoints" / LAST
    # init_from=DIR: the first step's loss is the source checkpoint's on that batch
    run, first = tmp_path / "continued", FirstBatch()
    train(tiny_config(tiny_data, run, *STEPS, f"init_from={exported}"), extra_callbacks=[first])
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
        train(tiny_config(tiny_data, tmp_path / "resumed", *STEPS, f"resume={exported}"))


LM_EVAL_HF = """
    import json
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    directory, tasks, limit, out = sys.argv[1:5]
    results = simple_evaluate(model="hf", model_args=f"pretrained={directory},trust_remote_code=True,dtype=float32",
                              tasks=["last_token"], task_manager=TaskManager(include_path=tasks), limit=int(limit),
                              device="cpu", log_samples=True)
    samples = sorted(results["samples"]["last_token"], key=lambda sample: sample["doc_id"])
    json.dump({"metrics": results["results"]["last_token"],
               "loglikelihoods": [float(response[0][0]) for sample in samples for response in sample["resps"]]},
              open(out, "w"))
"""
# keel_last_token's own YAML, reading its generated file directly (the bundled one loads it through keel)
LAST_TOKEN_TASK = """task: last_token
dataset_path: json
dataset_kwargs: {{data_files: {{test: {path}}}}}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
metric_list:
  - {{metric: perplexity, aggregation: perplexity, higher_is_better: false}}
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
"""


def test_lm_eval_hf_model_scores_the_export_as_keel_scores_the_checkpoint(corpus_dir, tokenizer_json, tmp_path):
    """At lm-eval's defaults (add_bos_token unset), on requests that fit seq_len whole, so an added BOS would show."""
    corpus = tmp_path / "corpus"  # held-out documents for the generated tasks
    corpus.mkdir()
    (corpus / VAL_DOCS).write_text("".join(json.dumps({"text": path.read_text()}) + "\n"
                                           for path in sorted(corpus_dir.glob("*.py"))[:6]))
    seq_len, limit = 512, 24
    _, checkpoint = random_checkpoint([f"model.seq_len={seq_len}"], tokenizer_json, tmp_path / "model.ckpt")
    directory = export(str(checkpoint), tmp_path / "hf")
    task_file = generate_tasks(corpus)["keel_last_token"]
    docs = [json.loads(line) for line in task_file.read_text().splitlines()[:limit]]
    lengths = [len(Tokenizer.from_str(tokenizer_json).encode(doc["context"] + doc["target"]).ids) for doc in docs]
    assert max(lengths) < seq_len  # nothing left-truncated: a BOS in front would be scored
    keel_out = tmp_path / "keel"
    assert cli_main(["eval", "--model_args", f"checkpoint={checkpoint}", "--tasks", "keel_last_token", "--limit",
                     str(limit), "--device", "cpu", "--log_samples", "--output_path", str(keel_out),
                     "--metadata", json.dumps({"corpus_dir": str(corpus)})]) == 0
    [results] = keel_out.rglob("results_*.json")
    keel_metrics = json.loads(results.read_text())["results"]["keel_last_token"]
    keel_samples = sorted((json.loads(line) for samples in keel_out.rglob("samples_*")
                           for line in samples.read_text().splitlines()), key=lambda sample: sample["doc_id"])
    keel_loglikelihoods = [float(response[0][0]) for sample in keel_samples for response in sample["resps"]]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "last_token.yaml").write_text(LAST_TOKEN_TASK.format(path=json.dumps(str(task_file))))
    standalone(LM_EVAL_HF, directory, tasks, limit, tmp_path / "hf.json")
    hf = json.loads((tmp_path / "hf.json").read_text())
    assert len(hf["loglikelihoods"]) == len(keel_loglikelihoods) == limit
    assert hf["loglikelihoods"] == pytest.approx(keel_loglikelihoods, abs=1e-4)
    metrics = {metric: value for metric, value in keel_metrics.items()
               if isinstance(value, float) and "stderr" not in metric}
    assert metrics and all(hf["metrics"][metric] == pytest.approx(value, rel=1e-5)
                           for metric, value in metrics.items())


CHATS = [{"messages": [{"role": "user", "content": f"what is {a} + {b}?"},
                       {"role": "assistant", "content": f"{a + b}"}]} for a in range(8) for b in range(4)]
CHAT_TEMPLATE_CHECK = """
    import json
    from transformers import AutoTokenizer
    from trl.chat_template_utils import has_generation_markers, is_chat_template_stop_token_trained

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
    chat = json.loads(sys.argv[2])
    whole = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True, return_dict=True)
    print(json.dumps({"ids": whole["input_ids"], "assistant": whole["assistant_masks"], "prompt": prompt["input_ids"],
                      "markers": has_generation_markers(tokenizer.chat_template),
                      "stop_trained": is_chat_template_stop_token_trained(tokenizer)}))
"""


def test_the_chat_template_ends_turns_with_eos_and_marks_the_assistants(exported, tokenizer_json):
    chat = [*CHATS[5]["messages"], {"role": "user", "content": "and 2 + 4?"}, {"role": "assistant", "content": "6"}]
    rendered = json.loads(standalone(CHAT_TEMPLATE_CHECK, exported, json.dumps(chat)).stdout)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos = eos_id_of(tokenizer)
    ids, assistant = rendered["ids"], rendered["assistant"]
    assert ids[0] == eos and ids.count(eos) == 1 + len(chat)  # a document start, and every turn ended
    turns = tokenizer.decode(ids, skip_special_tokens=False).split(tokenizer.id_to_token(eos))[1:-1]
    assert turns == [f"{message['role']}:\n{message['content']}" for message in chat]
    # the loss of TRL's assistant_only_loss: each answer and the EOS after it, nothing else
    spans = [run for run in "".join(map(str, assistant)).split("0") if run]
    marked = tokenizer.decode([token for token, flag in zip(ids, assistant) if flag], skip_special_tokens=False)
    assert len(spans) == 2 and marked == "".join(message["content"] + tokenizer.id_to_token(eos)
                                                 for message in chat[1::2])
    assert rendered["markers"] and rendered["stop_trained"]  # TRL's own checks
    # generation continues the prompt as training saw the chat: the prompt is the chat's own prefix
    prompt = rendered["prompt"]
    assert ids[:len(prompt)] == prompt and tokenizer.decode(prompt).endswith("assistant:\n")


def test_trl_fine_tunes_the_export_and_the_result_loads_again(exported, tmp_path):
    """SFT on the export's own chat template, packed (TRL's bfd, padding-free) and on the answers only."""
    trl = pytest.importorskip("trl", reason="the TRL test needs the test extra")
    from datasets import Dataset

    model, tokenizer = load_hf(exported)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=4, per_device_train_batch_size=4,
                         learning_rate=1e-3, max_length=32, packing=True, assistant_only_loss=True, report_to=[],
                         logging_steps=1, save_strategy="no", use_cpu=True, dataloader_num_workers=0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(CHATS),
                             processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch and batch["position_ids"].shape[0] == 1  # packed, padding-free
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    trainer.save_model(tmp_path / "tuned")
    tuned, tuned_tokenizer = load_hf(tmp_path / "tuned")
    assert tuned_tokenizer.chat_template == tokenizer.chat_template
    changed = [name for name, param in tuned.named_parameters() if not torch.equal(param, before[name])]
    assert len(changed) == len(before)  # every parameter trained, and saved
    prompt = tuned_tokenizer.apply_chat_template(CHATS[0]["messages"][:1], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert tuned.generate(**prompt, max_new_tokens=4, do_sample=False).shape[1] > prompt["input_ids"].shape[1]


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
        capsys.readouterr().out)


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


def test_peft_lora_adapters_train_on_the_export(exported, tmp_path):
    peft = pytest.importorskip("peft", reason="the PEFT test needs the test extra")
    model, tokenizer = load_hf(exported)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["qkv", "out", "up", "down"],
                                                      task_type="CAUSAL_LM"))
    trainable = [name for name, param in lora.named_parameters() if param.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    base = {name: param.detach().clone() for name, param in lora.named_parameters() if not param.requires_grad}
    ids = tokenizer(["def main():\n    return 0\n"] * 4, return_tensors="pt").input_ids
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(param, base[name]) for name, param in lora.named_parameters() if name in base)
    lora.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(hf_model(exported), tmp_path / "adapter").eval()
    lora.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, lora(ids).logits, rtol=0, atol=1e-6)


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
        tiny_run, exported, tmp_path, capsys):
    """A checkpoint or export whose config says depth 1,000,000 over 2 blocks of weights drove `keel generate`
    past 10 GB (it built KeelLM(cfg.model) first): every loader now refuses it in one line, and a consistent model
    too big for this machine is refused with its estimate, before it is built."""
    source = tiny_run / "checkpoints" / LAST
    edited = [with_config(source, tmp_path / "deep.ckpt", depth=1_000_000),
              with_config(exported, tmp_path / "deep-hf", depth=1_000_000)]
    for path in edited:
        said = f"checkpoint: {path}: its config says model.depth=1000000, its weights hold 2 blocks"
        for argv in (["generate", f"checkpoint={path}"], ["export", str(path), "--out", str(tmp_path / "out")],
                     ["gradflow", "--checkpoint", str(path)], ["redundancy", str(path), "--out", str(tmp_path / "r")],
                     ["eval", "--model_args", f"checkpoint={path}", "--tasks", "keel_next_line", "--device", "cpu"]):
            assert cli_main(argv) == 2, argv
            err = capsys.readouterr().err.splitlines()
            assert err[-1].startswith(f"keel {argv[0]}: config error: {said}"), (argv, err)
        assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()
    wide = with_config(exported, tmp_path / "wide-hf", width=64)
    with pytest.raises(ConfigError, match=r"its weights do not match its model config \(shapes embed.weight "
                                          r"\(512, 32\) \(config: \(512, 64\)\)"):
        load_model(wide)
    # in a process of its own: refused before anything of the config's size is allocated
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, "generate", f"checkpoint={edited[1]}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "its config says model.depth=1000000" in done.stderr
    assert int(done.stderr.splitlines()[-1]) < 2**31  # 2 GiB; it passed 10 GB before


def test_a_model_too_big_for_this_machine_is_refused_with_its_estimate_before_it_is_built(
        tiny_run, monkeypatch, capsys):
    monkeypatch.setattr("keel.memory.available_bytes", lambda: 1000)
    built = []
    monkeypatch.setattr(KeelLM, "__init__", lambda *args: built.append(args))
    source = tiny_run / "checkpoints" / LAST
    assert cli_main(["generate", f"checkpoint={source}"]) == 2
    assert re.fullmatch(rf"keel generate: config error: checkpoint: {re.escape(str(source))}: its model "
                        r"\(model.depth=2, model.width=32, model.seq_len=32\) needs about 0.0 GiB \([\d,]+ parameters: "
                        r"fp32 weights; plus activations\), more than the 0.0 GiB available here; use a machine with "
                        r"more memory", capsys.readouterr().err.strip())
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
    narrowed = {name: (t[:, :16].contiguous() if name.endswith("embed_tokens.weight") else t)
                for name, t in weights.items()}
    cases = {
        "truncated": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
                      r"model.safetensors cannot be read \(corrupt or truncated\?\): "),
        "bad-json": (lambda d: (d / "config.json").write_text('{"model_type": "keel", "ke'),
                     r"config.json cannot be read \(corrupt or truncated\?\): "),
        "listed": (lambda d: (d / "config.json").write_text("[1, 2]"),
                   r"config.json holds a list, not the JSON object an export writes"),
        "outside": (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(index)),
                    r"model.safetensors.index.json refused: its weight_map must name weight files in .* itself"),
        "renamed": (lambda d: save_file(renamed, d / "model.safetensors"),
                    r"holds weights a keel export never has \(model.extra.lm_head.weight\)"),
        "narrowed": (lambda d: save_file(narrowed, d / "model.safetensors"),
                     r"its weights do not match its model config \(shapes embed.weight \(512, 16\)"),
    }
    for name, (damage, said) in cases.items():
        path = damaged(name, damage)
        assert cli_main(["generate", f"checkpoint={path}"]) == 2, name
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and re.match(f"keel generate: config error: checkpoint: {tmp_path}/{name}.*{said}",
                                          err[0]), (name, err)
    with pytest.raises(ConfigError, match=rf"init_from: {tmp_path}/narrowed: its weights do not match"):
        train(tiny_config(tiny_data, tmp_path / "run", *STEPS, f"init_from={tmp_path / 'narrowed'}"))
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    assert cli_main(["export", str(exported), "--out", str(blocker / "hf")]) == 2  # was FileExistsError
    assert capsys.readouterr().err == (f"keel export: config error: export: cannot write {blocker / 'hf'}: {blocker} "
                                       "is a file, not a directory; choose another --out\n")
