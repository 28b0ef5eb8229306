"""Downstream evaluation in Keel: the lm-eval adapter against the model's own log-probabilities, generation stops,
the in-loop callback leaving training untouched, a generated task rising above chance after a short run."""

from __future__ import annotations

import json
import random

import pytest
import torch
from lm_eval.api.instance import Instance

from keel.checkpoint.read import load_model
from keel.cli import main as cli_main
from keel.evaluation import KeelEvalLM
from keel.evaluation.offline import STANDARD_TASKS as LM_EVAL_STANDARD
from keel.training import train
from keeltest.evaluation import SHORT_RUN, config
from keeltest.runs import scalars


def reference_logprob(model, ids: list[int], n_continuation: int) -> tuple[float, bool]:
    """Summed log p of the last n_continuation of ids, one unpadded forward of the last seq_len + 1 tokens."""
    ids = ids[-(model.cfg.seq_len + 1) :]
    with torch.no_grad():
        logprobs = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)[-n_continuation:]
    target = torch.tensor(ids[-n_continuation:])
    return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


def test_loglikelihood_is_the_models_own_logprob(checkpoint):
    model, cfg, tokenizer_json = load_model(checkpoint)
    lm = KeelEvalLM(model=model, tokenizer_json=tokenizer_json, batch_size=3)  # padded batches of mixed lengths
    encode = lm.tok_encode
    long_context = "x = compute(value)\n" * 40  # far beyond seq_len: left-truncated
    cases = [
        ("def f(x):", "\n    return x + 1"),
        ("import os", "\nimport sys"),
        (long_context.strip(), "\ny = 2"),
        ("class A:\n    pass", "\n"),
    ]
    results = lm.loglikelihood([Instance("loglikelihood", {}, case, i) for i, case in enumerate(cases)])
    for (context, continuation), (logprob, greedy) in zip(cases, results):
        whole, ctx = encode(context + continuation), encode(context)
        assert whole[: len(ctx)] == ctx  # a token boundary between the two: the reference is unambiguous
        ref_logprob, ref_greedy = reference_logprob(model, whole, len(whole) - len(ctx))
        assert logprob == pytest.approx(ref_logprob, abs=1e-4) and greedy == ref_greedy

    # Empty context: conditioned on EOS, as lm-eval's HF model does.
    [(logprob, _)] = lm.loglikelihood([Instance("loglikelihood", {}, ("", "import os"), 0)])
    ids = encode("import os")
    assert logprob == pytest.approx(reference_logprob(model, [lm.eot_token_id] + ids, len(ids))[0], abs=1e-4)

    # Rolling: every token once, each window the seq_len tokens before the ones it scores, EOS first.
    text = "def f(a, b):\n    return a * b + 1\n" * 12
    seq, L = [lm.eot_token_id] + encode(text), cfg.model.seq_len
    assert len(seq) > 3 * L
    expected = sum(
        reference_logprob(model, seq[max(0, end - L) : end + 1], end - start)[0]
        for start, end in ((s, min(s + L, len(seq) - 1)) for s in range(0, len(seq) - 1, L))
    )
    [total] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert total == pytest.approx(expected, abs=1e-3)


def test_generate_until_honours_stop_sequences(checkpoint):
    model, _, tokenizer_json = load_model(checkpoint)
    lm = KeelEvalLM(model=model, tokenizer_json=tokenizer_json)
    context = "def main():\n    "

    def generate(gen_kwargs: dict) -> str:
        return lm.generate_until([Instance("generate_until", {}, (context, gen_kwargs), 0)])[0]

    free = generate({"until": [], "max_gen_toks": 12})
    assert len(lm.tok_encode(free)) <= 12 and free == generate({"until": [], "max_gen_toks": 12})  # greedy
    stop = free[len(free) // 2 :][:2]
    assert len(stop) == 2 and generate({"until": [stop], "max_gen_toks": 12}) == free[: free.index(stop)]


def test_in_loop_evaluation_leaves_training_unchanged(eval_data, baseline, manager, tmp_path, capsys):
    run = tmp_path / "with_eval"
    train(config(eval_data, run, *SHORT_RUN))
    assert scalars(run, "train/loss") == scalars(baseline, "train/loss")  # every step, bit for bit
    assert len(scalars(run, "train/loss")) == 30

    history = json.loads((run / "eval_history.json").read_text())
    assert [e["step"] for e in history["evaluations"]] == [9, 19, 29]
    assert history["tasks"]["keel_next_line"] == {"metric": "acc_mutual_info", "higher_is_better": True}
    val_loss = scalars(run, "val/loss")
    for evaluation in history["evaluations"]:  # next to validation loss, on its x-axis
        assert evaluation["val_loss"] == pytest.approx(val_loss[evaluation["step"]])
        assert scalars(run, "eval/keel_next_line/acc_mutual_info")[evaluation["step"]] == pytest.approx(
            evaluation["scores"]["keel_next_line"]["acc_mutual_info"]
        )
    assert set(scalars(run, "time/downstream_eval_s")) == {9, 19, 29}
    assert set(scalars(run, "eval/disagree/keel_last_token")) == {19, 29}
    assert set(history["spearman"]) == {"keel_next_line", "keel_last_token"}

    png = tmp_path / "compare.png"
    assert cli_main(["compare", str(baseline), str(run), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000
    assert cli_main(["compare", str(run), "--out", str(png), "--train-loss", "--window", "5"]) == 0
    assert "detrended train/loss (window 5), lag-1 autocorrelation" in capsys.readouterr().out


def test_detrended_autocorrelation_tells_independent_from_correlated_steps():
    from keel.evaluation.compare import detrended, lag1_autocorrelation

    rng = random.Random(0)
    independent = [(step, 5 - step / 100 + rng.gauss(0, 0.3)) for step in range(400)]  # a trend plus noise
    regimes = [(step, 5 - step / 100 + (2.0 if (step // 32) % 2 else 0.0) + rng.gauss(0, 0.3)) for step in range(400)]
    assert abs(lag1_autocorrelation([v for _, v in detrended(independent, 25)])) < 0.15
    assert lag1_autocorrelation([v for _, v in detrended(regimes, 25)]) > 0.5


def test_a_generated_task_rises_above_chance_after_a_short_training_run(eval_data, manager, tmp_path):
    """300 steps of a 2-block model (~25 s on an idle 2-core CPU): keel_next_line's acc_mutual_info goes from
    chance (25%) to ~45% on 500 documents, where 32% is already 3.5 standard errors above chance."""
    run = tmp_path / "learn"
    train(
        config(
            eval_data,
            run,
            "model.width=64",
            "model.seq_len=128",
            "trainer.micro_batch_size=8",
            "trainer.max_steps=300",
            "trainer.val_every_n_steps=300",
            "trainer.val_batches=2",
            "trainer.checkpoint_every_n_steps=300",
            "eval.every_n_steps=300",
            "eval.limit=500",
            "eval.tasks=[keel_next_line]",
        )
    )
    [evaluation] = json.loads((run / "eval_history.json").read_text())["evaluations"]
    assert evaluation["scores"]["keel_next_line"]["acc_mutual_info"] > 0.32


def test_the_standard_suite_is_one_list():
    """`keel eval-data fetch`'s default suite and eval=standard's lm-eval tasks are the same list, but for gsm8k,
    which the eval group leaves out (5-shot generation: ~0 below a few B parameters; its YAML says so)."""
    import yaml

    from keel.config import conf_dir

    tasks = yaml.safe_load((conf_dir() / "eval" / "standard.yaml").read_text())["tasks"]
    assert [t for t in tasks if not t.startswith("keel_")] == [t for t in LM_EVAL_STANDARD if t != "gsm8k"]


def test_a_disagreement_is_said_at_the_step_the_bar_counts():
    """The history keeps 0-based steps (TensorBoard's x-axis); the console counts steps taken, as the bar does: the
    evaluation after step 200 said 'step 199'."""
    from keel.callbacks.downstream_eval import DownstreamEval
    from keel.config import load_config

    said = []
    evaluation = DownstreamEval(load_config())
    evaluation.primary = {"keel_next_line": ("acc_mutual_info", True)}
    module = type("Module", (), {"print": staticmethod(said.append)})()
    before = {"step": 99, "val_loss": 5.5676, "scores": {"keel_next_line": {"acc_mutual_info": 0.55}}}
    after = {"step": 199, "val_loss": 5.2072, "scores": {"keel_next_line": {"acc_mutual_info": 0.54}}}
    assert evaluation._disagreements(module, before, after) == {"eval/disagree/keel_next_line": 1.0}
    assert said == [
        "downstream eval: step 200: val loss 5.5676 -> 5.2072 (better) but keel_next_line acc_mutual_info "
        "0.5500 -> 0.5400 (worse)"
    ]
