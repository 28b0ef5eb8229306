"""trainer.loggers: TensorBoard, CSV, W&B (offline) and MLflow (local files) through Lightning's loggers; text and
figures reach the loggers that show them and are skipped on the others."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import CSVLogger

import keel.config.trainer
from keel.callbacks.log_writing import log_text
from keel.callbacks.per_layer import Heatmap
from keel.errors import ConfigError
from keel.loggers import LOGGERS, LoggerKind
from keel.training import build_loggers, train
from keeltest.runs import CrashAtStep, scalars, tiny_config

STEPS = [
    "trainer.max_steps=4",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.val_every_n_steps=4",
    "trainer.val_batches=1",
    "callbacks.grad_norms.every_n_steps=1",
    "callbacks.grad_norms.heatmap_every_n_steps=2",
]


def csv_rows(run: Path) -> list[dict]:
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_csv_logger_and_resume_keeps_its_history(tiny_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, *STEPS, "trainer.loggers=[csv,tensorboard]", "trainer.max_steps=2"))
    train(tiny_config(tiny_data, run, *STEPS, "trainer.loggers=[csv,tensorboard]", "resume=auto"))
    losses = {}
    for metrics in sorted((run / "csv").glob("version_*/metrics.csv")):  # one version per start
        with open(metrics) as f:
            losses |= {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row["train/loss"]}
    assert losses == pytest.approx(scalars(run, "train/loss"), rel=1e-6) and sorted(losses) == [0, 1, 2, 3]
    assert (run / "csv" / "version_0" / "hparams.yaml").read_text().count("micro_batch_size: 4") == 1


def test_wandb_without_an_api_key_says_how_to_log_in_or_go_offline(tiny_data, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no stored key
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # and no terminal to ask on
    try:
        with pytest.raises(
            ConfigError,
            match=r"^trainer.loggers: wandb cannot start a run: No API key configured.*"
            r"`wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline",
        ):
            train(tiny_config(tiny_data, tmp_path / "run", *STEPS, "trainer.loggers=[wandb]"))
    finally:
        wandb.teardown()  # wandb keeps its settings in a process-wide singleton: later runs must read theirs afresh


def test_wandb_offline_and_mlflow_get_scalars_figures_and_text(tiny_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    cfg = tiny_config(tiny_data, run, *STEPS, "trainer.loggers=[wandb,mlflow,csv]")
    # the grad-norm heatmap is drawn at steps 1 and 3: for W&B and MLflow, not CSV
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg, extra_callbacks=[CrashAtStep(3)])
    # from step 3: the crash saved the last completed step
    train(tiny_config(tiny_data, run, *STEPS, "trainer.loggers=[wandb,mlflow,csv]", "resume=auto"))

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs(
        [client.get_experiment_by_name("keel").experiment_id]
    )  # continued, not a new one
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")] == [0, 1, 2, 3]
    assert mlflow_run.data.params["trainer/micro_batch_size"] == "4"
    heatmaps = [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "grad/heatmap/branch_weights")]
    assert [Path(p).name for p in heatmaps] == ["step_000001.png", "step_000003.png"]
    first, resumed = sorted((run / "wandb").glob("offline-run-*"))
    assert first.name.split("-")[-1] == resumed.name.split("-")[-1]  # one W&B run id (`wandb sync` joins them)
    assert [len(list(part.glob("files/media/images/grad/heatmap/*.png"))) for part in (first, resumed)] == [1, 1]
    assert [row["step"] for row in csv_rows(run) if row["train/loss"]] == ["0", "1", "2"]

    # text: to TensorBoard, W&B and MLflow; CSV has no place for it and is skipped
    cfg = tiny_config(tiny_data, tmp_path / "text", "trainer.loggers=[tensorboard,csv,wandb,mlflow]")
    loggers = build_loggers(cfg)
    trainer = SimpleNamespace(is_global_zero=True, loggers=loggers)
    log_text(trainer, "stability/events", "step 7: a loss spike", 7)
    heatmap = Heatmap("test/heatmap", ["block 0", "block 1"], "value")
    heatmap.add(7, [1.0, 2.0])
    heatmap.log(trainer, 7)
    for logger in loggers:
        logger.finalize("success")
    loggers[2].experiment.finish()
    mlflow_logger = loggers[3]
    text = mlflow_logger.experiment.download_artifacts(
        mlflow_logger.run_id, "stability/events/step_000007.txt", str(tmp_path)
    )
    assert Path(text).read_text() == "step 7: a loss spike"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "text" / "tb"), size_guidance={"tensors": 0, "images": 0})
    events.Reload()
    assert "stability/events/text_summary" in events.Tags()["tensors"] and "test/heatmap" in events.Tags()["images"]
    (wandb_text,) = (tmp_path / "text" / "wandb").glob("offline-run-*")
    assert list(wandb_text.glob("files/media/table/stability/events*.table.json"))


def test_unknown_or_missing_logger_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(
        ConfigError, match="trainer.loggers: unknown logger.s. comet; allowed: tensorboard, csv, wandb, mlflow"
    ):
        tiny_config([], tmp_path, "trainer.loggers=[tensorboard,comet]")
    with pytest.raises(ConfigError, match="name each logger once"):
        tiny_config([], tmp_path, "trainer.loggers=[]")
    import lightning.pytorch.loggers.wandb as wandb_logger

    monkeypatch.setattr(wandb_logger, "_WANDB_AVAILABLE", False)  # as without the package
    with pytest.raises(ConfigError, match=r"trainer.loggers: wandb needs its package: pip install 'keel\[wandb\]'"):
        build_loggers(tiny_config([], tmp_path, "trainer.loggers=[wandb]"))


class ToyLogger(CSVLogger):
    """A logger of a kind the registry does not know yet: CSV's files, plus text kept in memory."""

    texts: list[tuple[str, str, int]] = []
    closed = False


class Toy(LoggerKind):
    name, logger_class = "toy", ToyLogger

    def build(self, run_dir, run_name, run_id):
        return ToyLogger(save_dir=run_dir, name="toy")

    def log_text(self, logger, tag, text, step):
        logger.texts.append((tag, text, step))

    def close(self, logger):
        type(logger).closed = True


def test_a_logger_is_a_name_and_a_record(tiny_data, tmp_path, monkeypatch):
    """Adding a logger is its name in keel.config.trainer.LOGGERS and its keel.loggers.LOGGERS record: with a toy one
    registered, trainer.loggers accepts its name, a run sends it scalars and text (the stability monitor's events),
    and it is closed at the end."""
    monkeypatch.setattr(keel.config.trainer, "LOGGERS", (*keel.config.trainer.LOGGERS, "toy"))
    monkeypatch.setitem(LOGGERS, "toy", Toy())
    run = tmp_path / "run"
    # an LR of 10 makes the loss rise within the 4 steps whatever the data drawn: the stability events are sure
    train(
        tiny_config(
            tiny_data,
            run,
            *STEPS,
            "trainer.loggers=[toy,tensorboard]",
            "optim.lr=10",
            "callbacks.stability.spike_margin=1e-9",
            "callbacks.stability.stop_on_failure=false",
        )
    )
    with open(run / "toy" / "version_0" / "metrics.csv") as f:
        assert [row["step"] for row in csv.DictReader(f) if row["train/loss"]] == ["0", "1", "2", "3"]
    assert ToyLogger.texts and all(tag == "stability/events" for tag, _, _ in ToyLogger.texts)
    assert ToyLogger.closed


def test_tensorboards_custom_scalars_show_the_losses_first_then_the_tasks(tiny_run):
    """The layout every run writes, read back from its event files; its loss chart draws the run's two losses."""
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    acc = EventAccumulator(str(tiny_run / "tb"))
    acc.Reload()
    [event] = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    assert [category.title for category in layout.category] == ["loss", "downstream tasks", "training"]

    def drawn(category: int, chart: int, tags: list[str]) -> list[str]:
        patterns = layout.category[category].chart[chart].multiline.tag
        return [tag for tag in tags if any(re.match(pattern, tag) for pattern in patterns)]

    assert sorted(drawn(0, 0, acc.Tags()["scalars"])) == ["train/loss", "val/loss"]
    tasks = [
        "eval/keel_next_line/acc_mutual_info",
        "eval/keel_next_line/acc",
        "eval/keel_last_token/perplexity",
        "eval/keel_gsm8k/exact_match/strict-match",
        "eval/disagree/keel_next_line",
        "eval/spearman/keel_next_line",
        "time/downstream_eval_s",
    ]  # eval tags as docs/evaluation.md names them
    assert drawn(1, 0, tasks) == [tasks[0], tasks[1], tasks[3]]
    assert drawn(1, 1, tasks) == [tasks[2]] and drawn(1, 2, tasks) == [tasks[5]]
