"""`keel export checkpoint=CKPT --out DIR [--dtype fp32|bf16] [--max-shard-size SIZE]`

Writes a trained model (a single-file or an FSDP sharded checkpoint) as a Hugging Face directory that transformers
loads offline (`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`, `AutoTokenizer`), and so
lm-eval's `hf` model, TRL and PEFT: config.json (each sublayer's norms and alpha spelled out, the run's Keel config
under "keel"), the self-contained remote code from keel/hf/, safetensors weights, the tokenizer, a chat template,
generation_config.json and a model card. No file holds a path of the training machine; the directory appears
whole or not at all, and `init_from=DIR` reads it back. What each file holds: docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from keel.checkpoint.exported import to_hf_names
from keel.checkpoint.payload import read_payload
from keel.checkpoint.read import checked_config, model_state_dict, read_checkpoint
from keel.config import from_dict, to_dict
from keel.config.model import needs_final_norm, sublayer_specs
from keel.data.tokenizer import eos_id_of
from keel.errors import ConfigError, refuse_output
from keel.model_card import model_card

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# For fine-tuning on chats (TRL): a chat is a document, so it starts after EOS, and every turn ends with EOS, which
# generation stops at. The assistant's content and its EOS are marked as generated ({% generation %}): what
# TRL's assistant_only_loss trains on, so the model learns to stop. "role:\n" keeps the content's first token the
# same whether the generation prompt or the whole chat is encoded.
CHAT_TEMPLATE = (
    "{{- eos_token -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] + ':\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:\n' -}}{%- endif -%}"
)


def _transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("export: needs transformers and safetensors: pip install 'keel[hf]'") from None
    from keel.hf.configuration_keel import KeelConfig
    from keel.hf.modeling_keel import KeelForCausalLM

    return KeelConfig, KeelForCausalLM


def hf_config(cfg, eos: int, step: int | None, heldout: dict | None = None):
    """The exported model's KeelConfig for a run's Config, trained for step optimizer steps; heldout: its last
    validation ({"step", "loss"}), kept for the model card of an export of the export."""
    KeelConfig, _ = _transformers()
    model = cfg.model
    return KeelConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.width,
        num_hidden_layers=model.depth,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.kv_heads,
        intermediate_size=model.ffn_hidden,
        hidden_act=model.ffn,
        max_position_embeddings=model.seq_len,
        rope_theta=model.rope_theta,
        rms_norm_eps=model.norm_eps,
        initializer_range=model.init_std,
        out_norm_gain=model.out_norm_gain,
        final_norm=needs_final_norm(model),
        scheme=model.scheme,
        logits_multiplier=model.mup_ratio,
        attention_scale=model.attention_scale,
        sublayers=[[asdict(attn), asdict(ffn)] for attn, ffn in sublayer_specs(model)],
        keel=without_machine_paths(to_dict(cfg)),
        trained_steps=step,
        heldout=heldout,
        tie_word_embeddings=model.tie_embeddings,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def without_machine_paths(value):
    """value (the run's config as a dict) with every absolute local path cut to its last part: run.dir, data.dir,
    init_from... name places on the machine that trained the model, which an export is shared beyond."""
    if isinstance(value, dict):
        return {key: without_machine_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_machine_paths(item) for item in value]
    if isinstance(value, str) and os.path.isabs(os.path.expanduser(value)):
        return Path(value).name
    return value


def hf_tokenizer(tokenizer_json: str, seq_len: int):
    """The run's tokenizer for transformers: its end-of-document token as EOS, BOS and padding, and a chat
    template (CHAT_TEMPLATE). It adds no special token, with or without add_special_tokens, so that lm-eval's `hf`
    model encodes (and scores) every request as `--model keel` does: a request is a window of text, usually from a
    document's middle, as a training window is; an EOS before it would say that a document starts there."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos_id = eos_id_of(tokenizer)
    eos = tokenizer.id_to_token(eos_id)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos,
        bos_token=eos,
        pad_token=eos,
        model_max_length=seq_len,
        chat_template=CHAT_TEMPLATE,
    )
    return wrapped, eos_id


def export(
    checkpoint_path: str, out: Path, dtype: str = "fp32", max_shard_size: str = "5GB", license: str = "other"
) -> Path:
    """Write checkpoint_path's model, tokenizer, generation defaults and model card (under license, an SPDX id
    or the hub's "other") to out (module docstring)."""
    _, KeelForCausalLM = _transformers()
    from transformers import GenerationConfig

    if dtype not in DTYPES:
        raise ConfigError(f"export: --dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out)
    refuse_output(out, "export", "--out", empty_dir_ok=True)
    checkpoint = read_checkpoint(checkpoint_path)
    payload = read_payload(checkpoint)
    tokenizer_json = payload.tokenizer_json
    if not tokenizer_json:
        raise ConfigError(
            f"export: {checkpoint_path} holds no tokenizer (tokenizer_json); a model without its "
            "tokenizer cannot be used outside Keel"
        )
    cfg = checked_config(checkpoint, checkpoint_path)
    tokenizer, eos = hf_tokenizer(tokenizer_json, cfg.model.seq_len)
    config = hf_config(cfg, eos, checkpoint.get("global_step"), payload.heldout)
    with torch.device("meta"):
        model = KeelForCausalLM(config)
    # checked against the config above; tied: KeelLM's state names the shared head too
    model.load_state_dict(to_hf_names(model_state_dict(checkpoint)), assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.to(DTYPES[dtype])
    for name, param in model.named_parameters():  # what transformers keeps fp32 on loading (modeling_keel.py)
        if any(module in name for module in KeelForCausalLM._keep_in_fp32_modules_strict):
            param.data = param.data.float()
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    type(config).register_for_auto_class()
    KeelForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    config.auto_map = {"AutoModel": "modeling_keel.KeelModel"}  # the base model too (value heads, embeddings)

    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(partial, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(partial)
        name_tokenizer_class_for_every_version(partial / "tokenizer_config.json")
        card = model_card(from_dict(config.keel), config.trained_steps, payload.heldout, license)
        (partial / "README.md").write_text(card)
        mode = 0o666 & ~_umask()  # transformers writes the weights 0600: readable as every other file here
        for path in partial.iterdir():
            path.chmod(mode)
        if out.exists():
            out.rmdir()  # empty (checked above)
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def name_tokenizer_class_for_every_version(tokenizer_config: Path) -> None:
    """transformers 5 saves its fast tokenizer's class as TokenizersBackend, which 4.x does not know; both know
    PreTrainedTokenizerFast (in 5, the same class), so the tokenizer alone loads on 4.x too."""
    settings = json.loads(tokenizer_config.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(settings, indent=2) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@torch.no_grad()
def verify(checkpoint_path: str, out: Path, new_tokens: int = 32) -> dict[str, float]:
    """The exported model against the checkpoint's KeelLM: the largest logit difference over 4 random sequences of
    seq_len tokens (and the logits' own largest magnitude, for scale), and how many of new_tokens greedy tokens
    after an end-of-document token (up to the next one) both decode alike: transformers' generate() against keel's
    KV-cache decoding."""
    from transformers import AutoModelForCausalLM

    from keel.checkpoint.read import load_model
    from keel.decoding import generate

    keel_model, cfg, _ = load_model(checkpoint_path)
    hf_model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    expected = keel_model(ids)
    difference = (hf_model(ids).logits.float() - expected).abs().max().item()
    eos = hf_model.generation_config.eos_token_id
    start, new_tokens = torch.tensor([[eos]]), min(new_tokens, cfg.model.seq_len - 1)
    keel_tokens = generate(keel_model, start, new_tokens, stop_tokens=(eos,))[0, 1:].tolist()  # both stop at EOS
    hf_tokens = hf_model.generate(start, max_new_tokens=new_tokens, do_sample=False)[0, 1:].tolist()
    agree = next(
        (i for i, pair in enumerate(zip(keel_tokens, hf_tokens)) if pair[0] != pair[1]),
        min(len(keel_tokens), len(hf_tokens)),
    )
    return {
        "max_logit_difference": difference,
        "max_logit": expected.abs().max().item(),
        "greedy_tokens_equal": agree,
        "greedy_tokens": len(keel_tokens),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="keel export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="checkpoint=PATH or PATH (a single file or an FSDP sharded directory)")
    parser.add_argument("--out", required=True, help="the directory to write (new, or empty)")
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=DTYPES,
        help="the matrices' dtype (the norms' gains stay fp32); default fp32, as trained",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="weights past this go into several shards + an index")
    parser.add_argument(
        "--license",
        default="other",
        help="the model card's license: an SPDX id such as apache-2.0 (default: other, none chosen)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="then load the directory with transformers and compare it with the checkpoint's model "
        "(logits, greedy decoding); the whole model is held twice in memory",
    )
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint.removeprefix("checkpoint=")
    out = export(checkpoint, Path(args.out), args.dtype, args.max_shard_size, args.license)
    files = sorted(path.name for path in out.iterdir())
    print(f"keel export: wrote {out}: {', '.join(files)}")
    print(f"  load it: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    if args.verify:
        check = verify(checkpoint, out)
        print(
            f"  verified: largest logit difference {check['max_logit_difference']:.2g} (largest logit "
            f"{check['max_logit']:.3g}); greedy decoding equal for {check['greedy_tokens_equal']} of "
            f"{check['greedy_tokens']} tokens"
        )
    return 0
