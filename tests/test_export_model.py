"""`keel export`'s model against the Keel model it came from: every scheme's logits, loss, KV cache and padding,
TRL's packed sequences, hidden states, attentions and the static cache as Llama's, greedy decoding."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers", reason="keel export needs the hf extra: pip install 'keel[hf]'")

from keel.checkpoint.layout import LAST  # noqa: E402
from keel.cli import main as cli_main  # noqa: E402
from keel.data.tokenizer import eos_id_of  # noqa: E402
from keel.decoding import generate  # noqa: E402
from keel.export import export  # noqa: E402
from keel.model import next_token_loss  # noqa: E402
from keeltest.export import VARIANTS, VOCAB, hf_model, load_hf, random_checkpoint, standalone  # noqa: E402


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
    assert packed["loss"].item() == pytest.approx(sum(losses).item() / sum(len(ids) - 1 for ids in examples), rel=1e-5)


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
                    "attentions": seen.attentions, "base": base(ids).last_hidden_state,
                    "base_class": type(base).__name__,
                    "greedy": greedy}, f"{work}/inside.pt")
"""


def test_hidden_states_attentions_base_model_and_static_cache_as_llamas(tokenizer_json, tmp_path):
    """output_hidden_states (a logit lens over them), output_attentions under attn_implementation="eager",
    AutoModel, and generate(cache_implementation="static"), standalone, against Keel's model."""
    model, checkpoint = random_checkpoint(
        ["model.scheme=hybridnorm", "model.n_kv_heads=2"], tokenizer_json, tmp_path / "m.ckpt"
    )
    directory = export(str(checkpoint), tmp_path / "hf")
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded by 3
    torch.save((ids, mask), tmp_path / "inputs.pt")
    standalone(LOOK_INSIDE, directory, tmp_path)
    inside = torch.load(tmp_path / "inside.pt")
    streams = []  # Keel's: the embedding's output and each block's
    hooks = [
        module.register_forward_hook(lambda _, args, out: streams.append(out.float()))
        for module in (model.embed, *model.blocks)
    ]
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


def test_greedy_generate_is_keel_generate(exported, tiny_run, capsys):
    prompt = "def "
    assert (
        cli_main(
            [
                "generate",
                f"checkpoint={tiny_run / 'checkpoints' / LAST}",
                "--prompt",
                prompt,
                "--max-new-tokens",
                "20",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    model, tokenizer = load_hf(exported)
    inputs = tokenizer(tokenizer.eos_token + prompt, return_tensors="pt")  # EOS first, as keel generate puts it
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new = out[0, inputs.input_ids.shape[1] :].tolist()
    assert len(new) >= 8  # a real continuation
    text = tokenizer.decode(new, skip_special_tokens=True)  # keel generate stops at EOS and does not print it
    assert printed == prompt + text + "\n"
