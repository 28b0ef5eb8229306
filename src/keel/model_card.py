"""The model card (README.md) that `keel export` writes beside the weights: the hub's metadata (license,
library_name, pipeline_tag), how to load the model, its scheme's formulas, its training data and steps, its held-out
loss, its intended use and license - all from the run's config and checkpoint (docs/export.md)."""

from __future__ import annotations

from pathlib import PurePath

from keel.config import Config
from keel.config.model import formulas, needs_final_norm
from keel.model import parameter_counts

PAPER = "https://arxiv.org/abs/2601.19895"
TRANSFORMERS_REQUIREMENT = "transformers>=5.24"  # what the remote code checks on import (keel/hf/)


def training_data(cfg: Config) -> str:
    data = cfg.data
    if data.source == "hf":
        return f"the Hugging Face dataset `{data.hf.dataset}` (`{data.hf.name}`, split `{data.hf.split}`)"
    if data.source == "stdlib":
        return "the Python standard library's source files"
    return f"{data.source} ({', '.join(f'`{path}`' for path in data.text_files.paths)})"


def heldout_line(heldout: dict | None, cfg: Config) -> str:
    if heldout is None:
        return "not in the checkpoint (saved before the run's first validation, or by an older Keel)."
    return (
        f"{heldout['loss']:.4f} nats per token at step {heldout['step']}, over {cfg.trainer.val_batches} "
        f"batches of {cfg.model.seq_len} tokens of the held-out split."
    )


def model_card(cfg: Config, steps: int | None, heldout: dict | None, license: str) -> str:
    """README.md for an export of a run with config cfg, trained for `steps` optimizer steps; heldout: the last
    validation before the checkpoint ({"step", "loss"}) or None."""
    model, trainer = cfg.model, cfg.trainer
    name = PurePath(cfg.run.dir).name
    millions = sum(parameter_counts(model).values()) / 1e6
    tokens_per_step = cfg.device_tokens_per_step * trainer.devices * trainer.num_nodes
    trained = "an unknown number of" if steps is None else f"{steps:,}"
    total = "" if steps is None else f", {steps * tokens_per_step:,} tokens in all"
    sublayer_lines = "\n".join(f"- `{formula}`: {count} sublayers" for formula, count in formulas(model))
    kv = "" if model.kv_heads == model.n_heads else f" ({model.kv_heads} key/value heads)"
    head_norm = (
        "An RMSNorm before the head"
        if needs_final_norm(model)
        else "No norm before the head (the last sublayer ends in one)"
    )
    license_note = (
        " No license was chosen at export (`keel export --license ID` sets one); the weights derive "
        "from the training data, whose terms apply."
        if license == "other"
        else ""
    )
    return f"""---
license: {license}
library_name: transformers
pipeline_tag: text-generation
tags:
- keel
- custom_code
---

# {name}

A {millions:.1f}M-parameter causal language model of scheme `{model.scheme}`: {model.depth} blocks
({2 * model.depth} sublayers) of width {model.width}, pretrained with Keel, the application that studies Keel
(Highway Post-LN, {PAPER}) and its baselines for very deep networks.

## Usage

Needs {TRANSFORMERS_REQUIREMENT}; the directory carries its own modeling code (`trust_remote_code=True`).

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)
inputs = tokenizer(tokenizer.eos_token + "def main(", return_tensors="pt")  # a document starts after EOS
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=50)[0], skip_special_tokens=True))
```

The tokenizer adds no special tokens, as the model was trained and as lm-eval's `hf` model then scores it.

## Architecture

Every sublayer (attention or FFN, `F`) is one of:

{sublayer_lines}

{head_norm};
{model.n_heads} attention heads{kv}, {model.ffn} FFN of {model.ffn_hidden}, RoPE (theta {model.rope_theta:g}),
context {model.seq_len} tokens, vocabulary {model.vocab_size}{", tied embeddings" if model.tie_embeddings else ""}.
`config.json` spells out every sublayer (`sublayers`) and holds the run's whole config (`keel`).

## Training

- Data: {training_data(cfg)}, one end-of-document token after every document.
- Steps: {trained} optimizer steps of {tokens_per_step:,} tokens{total}; AdamW, peak learning rate
  {cfg.optim.lr:g}, {cfg.optim.warmup_steps} warmup steps.
- Held-out loss: {heldout_line(heldout, cfg)}

## Intended use

Research on training deep language models: fine-tuning it (TRL, PEFT), scoring it (lm-eval), reading its hidden
states and attentions. It knows only its training data and is neither instruction- nor safety-tuned: not for
products or for text that people rely on.

## License

`{license}`.{license_note}
"""
