"""The export in other tools: lm-eval's `hf` model scores it as `--model keel` scores the checkpoint, its chat
template, TRL fine-tuning it and PEFT's LoRA adapters training on it."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers", reason="keel export needs the hf extra: pip install 'keel[hf]'")

from keel.cli import main as cli_main  # noqa: E402
from keel.data.generated_tasks import generate_tasks  # noqa: E402
from keel.data.shards import VAL_DOCS  # noqa: E402
from keel.data.tokenizer import eos_id_of  # noqa: E402
from keel.export import export  # noqa: E402
from keeltest.export import hf_model, load_hf, random_checkpoint, standalone  # noqa: E402

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
    (corpus / VAL_DOCS).write_text(
        "".join(json.dumps({"text": path.read_text()}) + "\n" for path in sorted(corpus_dir.glob("*.py"))[:6])
    )
    seq_len, limit = 512, 24
    _, checkpoint = random_checkpoint([f"model.seq_len={seq_len}"], tokenizer_json, tmp_path / "model.ckpt")
    directory = export(str(checkpoint), tmp_path / "hf")
    task_file = generate_tasks(corpus)["keel_last_token"]
    docs = [json.loads(line) for line in task_file.read_text().splitlines()[:limit]]
    lengths = [len(Tokenizer.from_str(tokenizer_json).encode(doc["context"] + doc["target"]).ids) for doc in docs]
    assert max(lengths) < seq_len  # nothing left-truncated: a BOS in front would be scored
    keel_out = tmp_path / "keel"
    assert (
        cli_main(
            [
                "eval",
                "--model_args",
                f"checkpoint={checkpoint}",
                "--tasks",
                "keel_last_token",
                "--limit",
                str(limit),
                "--device",
                "cpu",
                "--log_samples",
                "--output_path",
                str(keel_out),
                "--metadata",
                json.dumps({"corpus_dir": str(corpus)}),
            ]
        )
        == 0
    )
    [results] = keel_out.rglob("results_*.json")
    keel_metrics = json.loads(results.read_text())["results"]["keel_last_token"]
    keel_samples = sorted(
        (json.loads(line) for samples in keel_out.rglob("samples_*") for line in samples.read_text().splitlines()),
        key=lambda sample: sample["doc_id"],
    )
    keel_loglikelihoods = [float(response[0][0]) for sample in keel_samples for response in sample["resps"]]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "last_token.yaml").write_text(LAST_TOKEN_TASK.format(path=json.dumps(str(task_file))))
    standalone(LM_EVAL_HF, directory, tasks, limit, tmp_path / "hf.json")
    hf = json.loads((tmp_path / "hf.json").read_text())
    assert len(hf["loglikelihoods"]) == len(keel_loglikelihoods) == limit
    assert hf["loglikelihoods"] == pytest.approx(keel_loglikelihoods, abs=1e-4)
    metrics = {
        metric: value for metric, value in keel_metrics.items() if isinstance(value, float) and "stderr" not in metric
    }
    assert metrics and all(hf["metrics"][metric] == pytest.approx(value, rel=1e-5) for metric, value in metrics.items())


CHATS = [
    {"messages": [{"role": "user", "content": f"what is {a} + {b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(8)
    for b in range(4)
]


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
    assert len(spans) == 2 and marked == "".join(
        message["content"] + tokenizer.id_to_token(eos) for message in chat[1::2]
    )
    assert rendered["markers"] and rendered["stop_trained"]  # TRL's own checks
    # generation continues the prompt as training saw the chat: the prompt is the chat's own prefix
    prompt = rendered["prompt"]
    assert ids[: len(prompt)] == prompt and tokenizer.decode(prompt).endswith("assistant:\n")


def test_trl_fine_tunes_the_export_and_the_result_loads_again(exported, tmp_path):
    """SFT on the export's own chat template, packed (TRL's bfd, padding-free) and on the answers only."""
    trl = pytest.importorskip("trl", reason="the TRL test needs the test extra")
    from datasets import Dataset

    model, tokenizer = load_hf(exported)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_length=32,
        packing=True,
        assistant_only_loss=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(CHATS), processing_class=tokenizer)
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
    prompt = tuned_tokenizer.apply_chat_template(
        CHATS[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        assert tuned.generate(**prompt, max_new_tokens=4, do_sample=False).shape[1] > prompt["input_ids"].shape[1]


def test_peft_lora_adapters_train_on_the_export(exported, tmp_path):
    peft = pytest.importorskip("peft", reason="the PEFT test needs the test extra")
    model, tokenizer = load_hf(exported)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["qkv", "out", "up", "down"], task_type="CAUSAL_LM")
    )
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
