"""`keel data` builds that fail: dying or failing shard writers, full disks, Ctrl-C, two builds of one data.dir,
and files no build wrote (docs/data.md, "Builds that fail")."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
from litdata.streaming.writer import BinaryWriter

import keel.data.shard_writing
from keel import cli
from keel.data.preparation import DataDirLock, prepare
from keel.data.shards import MANIFEST, PUBLISHING, STAGING, TOKENIZER
from keel.dirlock import LOCK
from keeltest.data import copy_of, overrides_for, write_corpus


def files_of(data_dir: Path) -> dict[str, bytes]:
    """A build's files by relative path (the lock file aside: it records who builds)."""
    return {
        str(path.relative_to(data_dir)): path.read_bytes()
        for path in sorted(data_dir.rglob("*"))
        if path.is_file() and path.name != LOCK
    }


def full_disk(self, raw_data, filename, compress=None):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def killed(self, span):  # as the out-of-memory killer would
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize(
    "failure, said",
    [
        (
            (BinaryWriter, "write_chunk_to_file", full_disk),
            "no space left on the device writing the shards in {shards}/"
            ".keel-build/train: free space or choose another data.dir / TMPDIR",
        ),
        (
            (keel.data.shard_writing.SpanEncoder, "__call__", killed),
            "the train shard writer (worker 0 of 1) was killed by "
            "SIGKILL (the kernel's out-of-memory killer sends it: use fewer data.prepare_workers, or more memory) "
            "before it was done",
        ),
    ],
)
def test_a_shard_writer_that_fails_or_dies_stops_the_build_and_keeps_the_earlier_one(
    built, tmp_path, monkeypatch, capsys, failure, said
):
    """The forked writers inherit the failure patched in here. litdata's optimize() hung when a worker failed after
    its last input (its main process joined a worker that was joining its own idle child), and a full disk read as a
    bare OSError."""
    shards = tmp_path / "shards"
    shutil.copytree(built.dir, shards)
    before = files_of(shards)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(*failure)
    assert cli.main(["data", "--force", *overrides_for(shards, corpus=built.root / "corpus")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"keel data: config error: {said.format(shards=shards)}"]
    assert files_of(shards) == before  # the earlier build, complete
    assert not (shards / STAGING).exists() and not list((tmp_path / "tmp").iterdir())  # no staging, no spool


FORKS_MAY_WRITE_4KB = """
import os, resource, sys
from keel import cli
os.register_at_fork(after_in_child=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
sys.exit(cli.main(["data", *sys.argv[1:]]))
"""


KEEL_DATA = "import sys\nfrom keel import cli\nsys.exit(cli.main(['data', *sys.argv[1:]]))"


def write_at_most(size: int):
    """A subprocess's preexec_fn: files of at most `size` bytes (past it a write fails with EFBIG, SIGXFSZ ignored)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return limit


def test_writes_that_run_out_of_room_fail_in_one_line_without_hanging(built, tmp_path):
    """Real failing writes, in real processes: a file size limit (RLIMIT_FSIZE) in the shard writers alone (keel
    data itself ignores SIGXFSZ, and they inherit that), then in the whole process, where the spool is written
    first. Either way: status 2, one line naming what was being written, nothing left behind, well before the
    timeout (the shard writers' case hung before)."""
    shards, tmp = tmp_path / "shards", tmp_path / "tmp"
    tmp.mkdir()
    environment = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    overrides = overrides_for(shards, corpus=built.root / "corpus")
    cases = [
        (
            FORKS_MAY_WRITE_4KB,
            None,
            re.escape(
                f"the file is too large (past a file size limit or the file system's) writing the shards in "
                f"{shards}/.keel-build/train: "
            ),
        ),
        (
            KEEL_DATA,
            write_at_most(16_384),
            re.escape(
                f"the file is too large (past a file size limit or the file system's) writing the spooled corpus in "
                f"{tmp}/keel-data-"
            )
            + r"\S+: ",
        ),
    ]
    for driver, preexec_fn, what in cases:
        done = subprocess.run(
            [sys.executable, "-c", driver, *overrides],
            env=environment,
            preexec_fn=preexec_fn,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert re.fullmatch(
            f"keel data: config error: {what}raise the file size limit \\(ulimit -f\\) or choose "
            "another data.dir / TMPDIR",
            done.stderr.splitlines()[-1],
        )
        assert not shards.exists() and not list(tmp.iterdir())  # the data.dir it made removed, lock file and all


def interrupt_when(process: subprocess.Popen, line_starts: str) -> float:
    """Ctrl-C, as a terminal sends it (SIGINT to the whole process group), once `process` has printed a line
    starting with `line_starts`; the time it was sent."""
    for line in process.stdout:
        if line.startswith(line_starts):
            break
    else:
        pytest.fail(f"keel data ended without printing {line_starts!r}: {process.communicate()[1]}")
    time.sleep(1)  # well into what the line announces
    os.killpg(process.pid, signal.SIGINT)
    return time.monotonic()


SLOW_SHARD_WRITERS = """
import sys, time
from keel import cli
from keel.data import shard_writing
encode = shard_writing.SpanEncoder.__call__
def encode_slowly(self, span):  # holds the forked shard writers at work, to be interrupted there
    time.sleep(600)
    return encode(self, span)
shard_writing.SpanEncoder.__call__ = encode_slowly
sys.exit(cli.main(["data", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("stage", ["BPE training", "shard writing"])
def test_ctrl_c_stops_keel_data_at_once_removing_the_unfinished_build(built, tmp_path, stage):
    """Exit status 130 and one line, within seconds; the earlier build intact, no staging, no spool, no worker left.
    Before, Ctrl-C waited for the BPE training to end (a Rust call holds Python's signal handling off), and while
    shards were written litdata's handler called os._exit(0): status 0, no word, a build without a manifest."""
    shards, tmp = tmp_path / "shards", tmp_path / "tmp"
    shutil.copytree(built.dir, shards)
    before = files_of(shards)
    tmp.mkdir()
    environment = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    if stage == "BPE training":  # ~3 MB of 200,000 distinct words: a long BPE training
        rng = random.Random(5)
        (tmp_path / "words").mkdir()
        for number in range(20):
            (tmp_path / "words" / f"{number}.txt").write_text(
                "\n".join(
                    " ".join("".join(rng.choices(string.ascii_lowercase, k=16)) for _ in range(100)) for _ in range(100)
                )
            )
        driver, overrides = KEEL_DATA, overrides_for(shards, "data.vocab_size=250000", corpus=tmp_path / "words")
        announced = "keel data: training a"
    else:
        driver, overrides = SLOW_SHARD_WRITERS, overrides_for(shards, corpus=built.root / "corpus")
        announced = "keel data: encoding the train split"
    # SIGINT as a terminal leaves it: the test suite run as a background job of a script starts with it ignored,
    # which the child would inherit (and Python then installs no KeyboardInterrupt handler)
    process = subprocess.Popen(
        [sys.executable, "-c", driver, "--force", *overrides],
        env=environment,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        sent = interrupt_when(process, announced)
        stderr = process.communicate(timeout=60)[1]
        stopped_in = time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stderr
    assert stderr.splitlines()[-1] == (
        f"keel data: interrupted: the unfinished build was removed; {shards} holds what it held before"
    )
    assert stopped_in < 5
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)  # no shard writer outlived it
    assert files_of(shards) == before
    assert not (shards / STAGING).exists() and not list(tmp.iterdir())


def test_a_second_build_of_a_data_dir_is_refused_naming_the_holder(built, tmp_path, capsys):
    """Two builds on one data.dir used to both say "wrote", the last silently replacing the other. The lock is
    taken to build only: an up-to-date data.dir is still read (and not written) while a build holds it."""
    shards = tmp_path / "shards"
    overrides = overrides_for(shards, corpus=built.root / "corpus")
    with DataDirLock(shards):
        assert cli.main(["data", *overrides]) == 2
        since = json.loads((shards / LOCK).read_text())["since"]
        assert capsys.readouterr().err.splitlines() == [
            f"keel data: config error: data.dir={shards} is in use by another keel process: pid {os.getpid()} on host "
            f"{socket.gethostname()} (since {since}). Two builds in one data.dir would replace each other's files; "
            "wait for it to end, stop it, or use another data.dir"
        ]
        assert sorted(path.name for path in shards.iterdir()) == [LOCK]  # nothing written
        up_to_date = copy_of(built, tmp_path / "copy")
        with DataDirLock(up_to_date.data.dir):
            assert prepare(up_to_date) == built.manifest
    (shards / STAGING / "train").mkdir(parents=True)  # what a build killed with -9 leaves
    (shards / STAGING / "train" / "chunk-0-0.bin").write_bytes(b"partial")
    assert cli.main(["data", *overrides]) == 0
    assert not (shards / STAGING).exists() and (shards / LOCK).read_text() == ""  # released


def test_keel_data_never_removes_what_no_build_wrote(built, tmp_path, capsys):
    """`keel data data.text_files.paths=[corp/train/*.txt,corp/val/*.txt] data.dir=corp` deleted the whole corpus:
    publishing replaced train/, val/, tokenizer.json and manifest.json in data.dir whether or not keel had made
    them."""
    corpus = tmp_path / "corp"
    write_corpus(corpus / "train")
    write_corpus(corpus / "val")
    (corpus / TOKENIZER).write_text("{}")  # the user's own
    before = files_of(corpus)
    overrides = [*overrides_for(corpus), f"data.text_files.paths=[{corpus}/train/*.txt,{corpus}/val/*.txt]"]
    assert cli.main(["data", *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"keel data: config error: data.dir={corpus} holds tokenizer.json, train/, val/, which no keel build wrote (a "
        "build would replace them); nothing was changed: choose a new or empty data.dir"
    ]
    assert files_of(corpus) == before and not (corpus / LOCK).exists()
    # an earlier build is replaced (--force), and one whose move into place was stopped is rebuilt; a user's file
    # inside a split is not shards
    shards = tmp_path / "shards"
    shutil.copytree(built.dir, shards)
    (shards / MANIFEST).unlink()
    (shards / PUBLISHING).write_bytes(b"")  # as an interrupted publish leaves it
    assert cli.main(["data", *overrides_for(shards, corpus=built.root / "corpus")]) == 0
    assert not (shards / PUBLISHING).exists() and json.loads((shards / MANIFEST).read_text())["tokens"]
    (shards / "val" / "notes.txt").write_text("mine")
    assert cli.main(["data", "--force", *overrides_for(shards, corpus=built.root / "corpus")]) == 2
    assert "holds val/, which no keel build wrote" in capsys.readouterr().err
    assert (shards / "val" / "notes.txt").read_text() == "mine"
