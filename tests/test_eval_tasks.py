"""The bundled tasks: generated tasks deterministic and well formed, every standard document with a valid gold
answer, deterministic scores, lm-eval's tasks from a fetched local copy, `keel eval` and its errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from lm_eval.api.registry import get_model

from keel.cli import main as cli_main
from keel.data.generated_tasks import TASKS_SUBDIR, generate_tasks
from keel.errors import ConfigError
from keel.evaluation import KeelEvalLM, load_tasks, run_tasks, task_manager
from keel.evaluation.offline import STANDARD_TASKS as LM_EVAL_STANDARD
from keel.evaluation.offline import lm_eval_configs, write_local_task
from keel.evaluation.suite import primary_metric
from keel.training import train
from keeltest import SHARED_DATA, shared_data, write_sharded
from keeltest.evaluation import SHORT_RUN, STANDARD_TASKS, config


def test_generated_tasks_are_deterministic_and_well_formed(eval_data, tmp_path):
    """keel data's tasks, those written into a writable data dir that had none, and those written under a run dir
    for a data dir that had none (never written into) are byte-identical."""
    copies = {}
    for name in ("writable", "older"):
        copies[name] = tmp_path / name
        copies[name].mkdir()
        shutil.copy(Path(eval_data) / "val_docs.jsonl", copies[name])
    run = tmp_path / "run"
    paths = generate_tasks(eval_data)
    again, elsewhere = generate_tasks(copies["writable"]), generate_tasks(copies["older"], tasks_dir=run)
    assert {path.parent for path in paths.values()} == {Path(eval_data, TASKS_SUBDIR)}  # written by keel data
    assert {path.parent for path in again.values()} == {copies["writable"] / TASKS_SUBDIR}
    assert [path.name for path in copies["older"].rglob("*")] == ["val_docs.jsonl"]  # the data dir is not written
    assert sorted(str(path.relative_to(run)) for path in run.rglob("*")) == sorted(  # no temporary file left
        [*(str(Path(TASKS_SUBDIR, f"{name}.jsonl")) for name in paths), TASKS_SUBDIR, str(Path(TASKS_SUBDIR).parent)]
    )
    for name, path in paths.items():
        assert path.read_bytes() == again[name].read_bytes() == elsewhere[name].read_bytes()
        assert 100 <= len(path.read_text().splitlines()) <= 500  # 500, or every candidate a small corpus has
    next_line = [json.loads(line) for line in paths["keel_next_line"].read_text().splitlines()]
    assert all(len({c.strip() for c in ex["choices"]}) == 4 and 0 <= ex["gold"] < 4 for ex in next_line)
    golds = [ex["gold"] for ex in next_line]
    assert min(golds.count(g) for g in range(4)) > 90  # the gold position is uniform: chance is 25%
    for ex in map(json.loads, paths["keel_last_token"].read_text().splitlines()):
        assert re.fullmatch(r"[A-Za-z_]\w{2,}", ex["target"]) and re.search(rf"\b{ex['target']}\b", ex["context"])


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


GENERATED_DOCS = 6  # per file of the generated benchmark files: gsm8k takes 5 few-shot examples


def write_benchmark_files(root: Path) -> Path:
    """GENERATED_DOCS documents per file in the original releases' formats, the layout of the keel_* tasks
    (docs/evaluation.md), with their quirks: ARC's numeric labels and 3- or 5-choice items, BoolQ's string labels,
    OpenBookQA's one-column choices, PIQA's separate label file, HellaSwag's 6-line text export."""
    n = range(GENERATED_DOCS)
    for name in ("Easy-Dev", "Easy-Test", "Challenge-Dev", "Challenge-Test"):
        labels = [["A", "B", "C", "D"], ["1", "2", "3", "4"], ["A", "B", "C"], ["A", "B", "C", "D", "E"]]
        write_jsonl(
            root / f"arc/ARC-{name}.jsonl",
            [
                {
                    "id": f"{name}-{i}",
                    "question": {
                        "stem": f"Which tool measures mass ({i})?",
                        "choices": [{"text": f"tool {c}", "label": c} for c in labels[i % 4]],
                    },
                    "answerKey": labels[i % 4][i % len(labels[i % 4])],
                }
                for i in n
            ],
        )
    write_jsonl(
        root / "boolq/val.jsonl",
        [
            {"question": f"is {i} even", "passage": f"{i} is a number.", "idx": i, "label": ["true", "false"][i % 2]}
            for i in n
        ],
    )
    for split in ("train", "test"):
        write_jsonl(
            root / f"gsm8k/{split}.jsonl",
            [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in n],
        )
    (root / "hellaswag").mkdir()
    (root / "hellaswag/hellaswag_val_full.txt").write_text(
        "".join(
            f"Cooking: a man cracks egg {i} into a bowl. he\n{i % 4}\n" + "".join(f"stirs it {e}.\n" for e in range(4))
            for i in n
        )
    )
    write_jsonl(root / "lambada/lambada_test.jsonl", [{"text": f"the cat sat on mat {i} and then the cat"} for i in n])
    (root / "openbookqa").mkdir()
    for split in ("dev", "test"):
        rows = [
            f"{split}-{i}\tThe sun is a\t(A) star (B) planet (C) moon (D) comet {i}\tThe sun is a star\tA" for i in n
        ]
        (root / f"openbookqa/{split}.tsv").write_text(
            "\n".join(["ID\tQuestion Stem\tChoices\tComplete Question\tAnswer Key", *rows]) + "\n"
        )
    write_jsonl(
        root / "piqa/valid.jsonl",
        [{"goal": f"open jar {i}", "sol1": "twist the lid", "sol2": "eat the lid"} for i in n],
    )
    (root / "piqa/valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in n))
    write_jsonl(
        root / "winogrande/winogrande.jsonl",
        [
            {
                "context_options": ["Ann helped Bo because Ann", "Ann helped Bo because Bo"],
                "continuation": f"was kind ({i}).",
                "gold": i % 2,
            }
            for i in n
        ],
    )
    return root


@pytest.fixture(scope="session", params=["generated", "shared"])
def benchmark_dir(request, tmp_path_factory) -> Path:
    """The keel_* tasks' files: generated here (always), and the full benchmark files beside the repository."""
    if request.param == "shared":
        return shared_data()
    return write_benchmark_files(tmp_path_factory.mktemp("benchmarks"))


@pytest.fixture(scope="session")
def standard_tasks(benchmark_dir, eval_data):
    return task_manager(data_dir=str(benchmark_dir), corpus_dir=eval_data).load(STANDARD_TASKS)["tasks"]


def gold_problem(task, doc) -> str | None:
    """Why a document has no valid gold answer, or None."""
    target = task.doc_to_target(doc)
    if task.OUTPUT_TYPE == "multiple_choice":
        choices = task.doc_to_choice(doc)
        gold = task.doc_to_text(doc) if task.multiple_input else target  # winogrande: the gold is the context
        if not (len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
            return f"bad choices {choices}"
        if not (isinstance(gold, int) and 0 <= gold < len(choices)):
            return f"gold {gold!r} not an index into {len(choices)} choices"
        return None if isinstance(target, (int, str)) and str(target) else f"empty target {target!r}"
    if task.OUTPUT_TYPE == "generate_until":  # gsm8k: the strict-match filter must find the answer
        return None if re.search(r"#### (\-?[0-9\.\,]+)", target) else f"no '#### <number>' in {target!r}"
    return None if isinstance(target, str) and target.strip() else f"empty target {target!r}"


def assert_valid_gold_answers(tasks: dict) -> dict[str, int]:
    """Every document of every split (test and few-shot alike, after the task's process_docs) has a valid gold
    answer; returns the number of documents per task/split."""
    sizes = {}
    for name, task in tasks.items():
        for split in task.dataset:
            docs = task.dataset[split]
            docs = task.config.process_docs(docs) if task.config.process_docs else docs
            problems = [(i, p) for i, doc in enumerate(docs) if (p := gold_problem(task, doc))]
            assert not problems, f"{name} {split}: {len(problems)} bad documents, e.g. {problems[:3]}"
            sizes[f"{name}/{split}"] = len(docs)
    return sizes


def test_every_standard_document_has_a_valid_gold_answer(standard_tasks, benchmark_dir):
    assert sorted(standard_tasks) == sorted(STANDARD_TASKS)
    sizes = assert_valid_gold_answers(standard_tasks)
    if benchmark_dir != SHARED_DATA:
        assert set(sizes.values()) == {GENERATED_DOCS}
        assert len(sizes) == 13  # ARC 2 tasks x 2 files, gsm8k 2, OpenBookQA 2, the five others 1
        return
    assert sizes["keel_hellaswag/validation"] == 10042 and sizes["keel_piqa/validation"] == 1838
    assert sizes["keel_arc_easy/test"] == 2376 and sizes["keel_boolq/validation"] == 3270
    assert sizes["keel_lambada_openai/test"] == 5153 and sizes["keel_winogrande/validation"] == 1267
    assert sizes["keel_openbookqa/test"] == 500 and sizes["keel_gsm8k/test"] == 1319


def test_standard_suite_scores_are_deterministic(checkpoint, standard_tasks):
    def scores():
        return run_tasks(KeelEvalLM(checkpoint=str(checkpoint), device="cpu"), standard_tasks, limit=3)

    first = scores()
    assert first == scores()
    assert set(first) == set(STANDARD_TASKS)
    for name, task in standard_tasks.items():
        metric, _ = primary_metric(task)
        assert metric in first[name]
    assert all(0 <= first[name]["acc"] <= 1 for name in STANDARD_TASKS if name != "keel_gsm8k")


def hub_rows(task: str, split: str, i: int) -> dict:
    """Row i of a split of the Hugging Face dataset each lm-eval task reads, in that dataset's schema."""
    if task.startswith("arc_"):
        return {
            "id": f"{split}-{i}",
            "question": f"Which tool measures mass ({i})?",
            "choices": {"text": ["a balance", "a ruler", "a clock", "a cup"], "label": ["A", "B", "C", "D"]},
            "answerKey": "ABCD"[i % 4],
        }
    return {
        "boolq": {"question": f"is {i} even", "passage": f"{i} is a number.", "idx": i, "label": i % 2},
        "hellaswag": {
            "ind": i,
            "activity_label": "Cooking",
            "ctx_a": f"A man cracks egg {i} [title] into a bowl.",
            "ctx_b": "he",
            "ctx": f"A man cracks egg {i} into a bowl. he",
            "endings": [f"stirs it {e}." for e in range(4)],
            "source_id": "x",
            "split": split,
            "split_type": "indomain",
            "label": str(i % 4),
        },
        "lambada_openai": {"text": f"the cat sat on mat {i} and then the cat"},
        "openbookqa": {
            "id": f"{split}-{i}",
            "question_stem": "The sun is a",
            "choices": {"text": ["star", "planet", "moon", "comet"], "label": ["A", "B", "C", "D"]},
            "answerKey": "A",
        },
        "piqa": {"goal": f"open jar {i}", "sol1": "twist the lid", "sol2": "eat the lid", "label": i % 2},
        "winogrande": {
            "sentence": f"Ann helped Bo because _ was kind ({i}).",
            "option1": "Ann",
            "option2": "Bo",
            "answer": str(1 + i % 2),
        },
        "gsm8k": {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"},
    }[task]


@pytest.fixture(scope="session")
def local_copies(tmp_path_factory) -> Path:
    """What `keel eval-data fetch DIR` writes for the nine standard tasks, from lm-eval's own configs and
    datasets in the hub's schemas (3 rows per split): the fetch minus its download."""
    import datasets

    root = tmp_path_factory.mktemp("eval_data")
    for name, cfg in lm_eval_configs(LM_EVAL_STANDARD).items():
        splits = {
            cfg[key] for key in ("training_split", "validation_split", "test_split", "fewshot_split") if cfg.get(key)
        }
        dataset = datasets.DatasetDict(
            {split: datasets.Dataset.from_list([hub_rows(name, split, i) for i in range(3)]) for split in splits}
        )
        assert write_local_task(cfg, dataset, root) == root / name / f"{name}.yaml"
    return root


def test_lm_evals_tasks_run_from_a_fetched_local_copy(local_copies, checkpoint):
    tasks = load_tasks(LM_EVAL_STANDARD, data_dir=str(local_copies))
    assert sorted(tasks) == sorted(LM_EVAL_STANDARD)  # lm-eval's names, in results and TensorBoard tags alike
    assert set(assert_valid_gold_answers(tasks).values()) == {3}
    # lm-eval's own process_docs and doc_to_* functions run on the local rows
    hellaswag = tasks["hellaswag"]
    [first] = list(hellaswag.validation_docs())[:1]
    assert hellaswag.doc_to_text(first) == "Cooking: A man cracks egg 0. into a bowl. He"
    winogrande = tasks["winogrande"]
    doc = winogrande.validation_docs()[1]
    assert winogrande.doc_to_choice(doc) == ["Ann helped Bo because Ann", "Ann helped Bo because Bo"]
    assert winogrande.doc_to_text(doc) == 1 and winogrande.doc_to_target(doc) == "was kind (1)."
    assert tasks["gsm8k"].config.num_fewshot == 5 and tasks["gsm8k"].config.fewshot_split == "train"

    scores = run_tasks(
        KeelEvalLM(checkpoint=str(checkpoint), device="cpu"),
        {name: tasks[name] for name in ("arc_easy", "hellaswag", "winogrande")},
        limit=2,
    )
    assert set(scores["arc_easy"]) == {"acc", "acc_norm"} and set(scores["winogrande"]) == {"acc"}
    assert all(0 <= value <= 1 for values in scores.values() for value in values.values())


def test_keel_eval_reads_lm_evals_task_from_its_local_copy(local_copies, checkpoint, tmp_path):
    out = tmp_path / "results"
    assert (
        cli_main(
            [
                "eval",
                "--model_args",
                f"checkpoint={checkpoint}",
                "--tasks",
                "arc_easy",
                "--limit",
                "2",
                "--device",
                "cpu",
                "--metadata",
                f"data_dir={local_copies}",
                "--output_path",
                str(out),
            ]
        )
        == 0
    )
    [results_file] = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["arc_easy"] == {"original": 3, "effective": 2}
    assert 0 <= results["results"]["arc_easy"]["acc,none"] <= 1


def test_without_local_copy_or_hub_the_error_names_both(checkpoint, eval_data, tmp_path, monkeypatch, capsys):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1, or no network
    assert (
        cli_main(
            [
                "eval",
                "--model_args",
                f"checkpoint={checkpoint}",
                "--tasks",
                "arc_easy",
                "--device",
                "cpu",
                "--output_path",
                str(tmp_path),
            ]
        )
        == 2
    )
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("keel eval: config error: Couldn't reach 'allenai/ai2_arc' on the Hub")
    assert "--metadata data_dir=DIR" in error and "keel eval-data fetch DIR" in error and "HF_DATASETS_OFFLINE" in error

    with pytest.raises(ConfigError, match=r"eval\.data_dir is not set.*Provide one of the two: eval\.data_dir=DIR"):
        train(config(eval_data, tmp_path / "run", *SHORT_RUN, "eval.tasks=[arc_easy]"))  # at setup, before step 1
    assert not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"has no copy of it.*eval\.data_dir=DIR"):
        load_tasks(["arc_easy"], data_dir=str(tmp_path))
    assert cli_main(["eval-data", "fetch", str(tmp_path / "copies"), "--tasks", "arc_easy"]) == 2
    assert "downloads from the Hugging Face hub: run it where the hub can be reached" in capsys.readouterr().err
    assert not (tmp_path / "copies").exists()


def test_keel_standard_tasks_without_data_dir_say_where_to_point_it():
    with pytest.raises(ConfigError, match=r"no directory is set: eval\.data_dir=DIR in training, --metadata"):
        load_tasks(["keel_arc_easy"])


def test_keel_eval_runs_a_local_task_and_writes_lm_evals_results(checkpoint, tmp_path):
    accuracy = {}
    # the checkpoint file, and the same laid out as FSDP writes it (a directory: it used to raise IsADirectoryError)
    for layout, path in (("file", checkpoint), ("sharded", write_sharded(checkpoint, tmp_path / "sharded.ckpt"))):
        out = tmp_path / layout
        # no corpus_dir given: the generated task finds its documents through the checkpoint's data.dir
        assert (
            cli_main(
                [
                    "eval",
                    "--model_args",
                    f"checkpoint={path}",
                    "--tasks",
                    "keel_next_line",
                    "--limit",
                    "8",
                    "--device",
                    "cpu",
                    "--output_path",
                    str(out),
                ]
            )
            == 0
        )
        [results_file] = out.rglob("results_*.json")
        results = json.loads(results_file.read_text())
        assert get_model("keel") is KeelEvalLM and results["config"]["model"] == "keel"
        assert results["n-samples"]["keel_next_line"]["effective"] == 8
        accuracy[layout] = results["results"]["keel_next_line"]["acc_mutual_info,none"]
    assert 0 <= accuracy["file"] == accuracy["sharded"] <= 1
