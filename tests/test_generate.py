"""`keel generate`: KV-cache decoding from a trained checkpoint, single-file or sharded."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from keel.checkpoint.layout import LAST
from keel.checkpoint.read import load_model
from keel.cli import main as cli_main
from keel.data.tokenizer import eos_id_of
from keel.generate import decoded_pieces
from keeltest import write_sharded

PROMPT = "def "


def generate(capsys, checkpoint, *options: str) -> str:
    assert cli_main(["generate", f"checkpoint={checkpoint}", "--prompt", PROMPT, *options]) == 0
    return capsys.readouterr().out


def test_greedy_decoding_is_the_argmax_of_a_full_forward(tiny_run, tmp_path, capsys):
    checkpoint = tiny_run / "checkpoints" / LAST
    printed = generate(capsys, checkpoint, "--max-new-tokens", "16", "--temperature", "0")

    model, _, tokenizer_json = load_model(checkpoint)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos = eos_id_of(tokenizer)
    ids = [eos, *tokenizer.encode(PROMPT, add_special_tokens=False).ids]
    prompt_len = len(ids)
    with torch.no_grad():
        for _ in range(16):  # no cache: every step recomputes the whole sequence
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token == eos:
                break
            ids.append(token)
    assert len(ids) - prompt_len >= 8  # a real continuation, not an immediate end of document
    continuation = tokenizer.decode(ids)[len(tokenizer.decode(ids[:prompt_len])) :]
    assert printed == PROMPT + continuation + "\n"
    # the same from the checkpoint laid out as FSDP writes it
    sharded = write_sharded(checkpoint, tmp_path / "sharded.ckpt")
    assert generate(capsys, sharded, "--max-new-tokens", "16", "--temperature", "0") == printed


def test_sampling_follows_seed_temperature_and_top_k(tiny_run, capsys):
    checkpoint = tiny_run / "checkpoints" / LAST
    options = ["--max-new-tokens", "24", "--temperature", "1.5", "--top-k", "0"]
    first = generate(capsys, checkpoint, *options, "--seed", "1")
    assert generate(capsys, checkpoint, *options, "--seed", "1") == first
    assert generate(capsys, checkpoint, *options, "--seed", "2") != first
    greedy = generate(capsys, checkpoint, "--max-new-tokens", "24", "--temperature", "0")
    assert generate(capsys, checkpoint, "--max-new-tokens", "24", "--temperature", "1.5", "--top-k", "1") == greedy
    threads = torch.get_num_threads()
    try:  # --threads changes the speed, not the text
        assert generate(capsys, checkpoint, "--max-new-tokens", "24", "--temperature", "0", "--threads", "2") == greedy
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_pieces_hold_back_split_characters(tiny_run):
    _, _, tokenizer_json = load_model(tiny_run / "checkpoints" / LAST)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    text = "naïve café → 数据"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    pieces = list(decoded_pieces(tokenizer, [], iter(ids)))
    assert "".join(pieces) == text and len(pieces) > 3
    assert not any("\ufffd" in piece for piece in pieces)


def test_generate_errors_name_the_option(tiny_run, capsys):
    checkpoint = tiny_run / "checkpoints" / LAST
    assert cli_main(["generate", str(checkpoint), "--max-new-tokens", "32"]) == 2
    assert "--max-new-tokens must be in [1, 31] (the model's seq_len is 32)" in capsys.readouterr().err
    assert cli_main(["generate", str(checkpoint), "--prompt", "def "]) == 0  # the default (100) was refused too
    assert capsys.readouterr().out.startswith("def ")
    assert cli_main(["generate", str(checkpoint), "--threads", "0"]) == 2
    assert "generate: --threads must be >= 1, got 0" in capsys.readouterr().err
    assert cli_main(["generate", "checkpoint=/nonexistent.ckpt"]) == 2
    assert "no file or directory at /nonexistent.ckpt" in capsys.readouterr().err
    for temperature in ("nan", "-1"):  # nan used to end in torch.multinomial's RuntimeError
        assert cli_main(["generate", str(checkpoint), "--temperature", temperature]) == 2
        assert capsys.readouterr() == (
            "",
            "keel generate: config error: generate: --temperature and --top-k must be "
            ">= 0 (0 = greedy / all tokens), got "
            f"--temperature {float(temperature)} --top-k 50\n",
        )
