"""An object-store data.dir (s3:// on a loopback moto server): `keel data` builds there, training streams it
like a local one, and the in-loop evaluation runs on it (#41)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from keel.config import load_config
from keel.data.preparation import prepare
from keel.data.shards import STAGING
from keel.errors import ConfigError


@pytest.fixture
def s3_bucket(monkeypatch, tmp_path) -> str:
    """An S3-compatible server (moto) on the loopback interface, over plain http like a typical MinIO, with one
    bucket; the standard AWS environment points at it. Returns the bucket's URL."""
    threaded = pytest.importorskip(
        "moto.moto_server.threaded_moto_server", reason="moto[server] is not installed (pip install -e '.[test]')"
    )
    import boto3

    server = threaded.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    try:
        server.start()
    except Exception as err:  # noqa: BLE001 - any failure to listen on loopback means: cannot test here
        pytest.skip(f"cannot start a loopback S3 server: {err}")
    host, port = server.get_host_and_port()
    nowhere = str(tmp_path / "none")  # no AWS config or credentials file of the machine's user
    for key, value in {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": nowhere,
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    boto3.client("s3").create_bucket(Bucket="keel-shards")
    yield "s3://keel-shards"
    server.stop()


def test_s3_data_dir_builds_and_trains_like_a_local_one(s3_bucket, corpus_dir, tmp_path):
    """`keel data` writes shards, tokenizer and manifest to s3://, and training streams them through litdata's
    cache: the losses equal those of the same build on local disk."""
    import boto3

    from keel.training import train
    from keeltest import QUIET_TRAINER, TINY_MODEL
    from keeltest.runs import scalars

    source = [
        "data=text_files",
        f"data.text_files.paths=[{corpus_dir}/*.py]",
        "data.vocab_size=512",
        "data.prepare_workers=1",
        "data.val_fraction=0.1",
    ]
    losses = {}
    for where, data_dir in (("local", str(tmp_path / "shards")), ("s3", f"{s3_bucket}/tiny")):
        overrides = [
            *TINY_MODEL,
            *QUIET_TRAINER,
            *source,
            f"data.dir={data_dir}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "eval.enabled=false",
            "trainer.max_steps=3",
            f"run.dir={tmp_path / where}",
        ]
        prepare(load_config(overrides=overrides))
        train(load_config(overrides=overrides))
        losses[where] = scalars(tmp_path / where, "train/loss")
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="keel-shards")["Contents"]}
    assert {"tiny/manifest.json", "tiny/tokenizer.json", "tiny/train/index.json", "tiny/val_docs.jsonl"} <= keys
    assert not [key for key in keys if key.startswith(f"tiny/{STAGING}/")]  # the staged build was moved into place
    assert any(path.suffix == ".bin" for path in (tmp_path / "cache").rglob("*"))  # chunks streamed, then cached
    assert len(losses["s3"]) == 3 and losses["s3"] == losses["local"]
    with pytest.raises(ConfigError, match=r"bucket 'no-such-bucket' cannot be found at http://127.0.0.1"):
        prepare(load_config(overrides=[*source, "data.dir=s3://no-such-bucket/tiny"]))


@pytest.mark.extended
@pytest.mark.slow
def test_s3_data_dir_trains_on_two_processes_with_the_in_loop_evaluation(s3_bucket, corpus_dir, tmp_path):
    """`keel data` writes the generated tasks beside the shards on s3://; for an older data.dir without them, rank 0
    of a 2-process FSDP run writes the same tasks under run.dir (the bucket is never written) and the in-loop
    evaluation runs."""
    import boto3

    from keel.data.generated_tasks import TASKS_SUBDIR, generate_tasks
    from keeltest import QUIET_TRAINER, TINY_MODEL

    data_dir = f"{s3_bucket}/tiny"
    source = [
        "data=text_files",
        f"data.text_files.paths=[{corpus_dir}/*.py]",
        f"data.dir={data_dir}",
        "data.vocab_size=512",
        "data.prepare_workers=1",
        "data.val_fraction=0.25",
        "model.seq_len=32",
    ]
    prepare(load_config(overrides=source))
    written = generate_tasks(data_dir)
    assert sorted(written.values()) == [
        f"{data_dir}/{TASKS_SUBDIR}/{name}.jsonl" for name in ("keel_last_token", "keel_next_line")
    ]
    s3 = boto3.client("s3")
    tasks_prefix = f"tiny/{TASKS_SUBDIR.split('/')[0]}/"
    contents = {}
    for name, url in written.items():
        key = url.split("/", 3)[3]
        contents[name] = s3.get_object(Bucket="keel-shards", Key=key)["Body"].read()
        s3.delete_object(Bucket="keel-shards", Key=key)  # now a data.dir built before `keel data` wrote them

    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "keel.cli",
        "pretrain",
        "trainer=fsdp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        *TINY_MODEL,
        *QUIET_TRAINER,
        *source,
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_steps=2",
        "trainer.val_every_n_steps=2",
        "trainer.val_batches=1",
        "eval.every_n_steps=2",
        "eval.limit=8",
        f"run.dir={run}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [evaluation] = json.loads((run / "eval_history.json").read_text())["evaluations"]
    assert set(evaluation["scores"]) == set(contents)
    for name, content in contents.items():
        assert (run / TASKS_SUBDIR / f"{name}.jsonl").read_bytes() == content
    assert not s3.list_objects_v2(Bucket="keel-shards", Prefix=tasks_prefix).get("Contents")
