"""The package on its own: the wheel and the sdist build without a setuptools warning, and the wheel, installed into
a fresh virtual environment away from the source tree, finds its conf groups and task YAMLs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from keeltest import REPO

# Top-level entries of a working tree that are not the project: environments, build outputs, runs, data
NOT_SOURCE = {".git", ".venv", "build", "dist", "keel.egg-info", "runs", "out", "data", ".pytest_cache"}


def run(*command: str | Path, **kwargs) -> str:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


@pytest.mark.slow
def test_wheel_builds_without_warnings_and_runs_from_a_fresh_venv(tmp_path):
    pytest.importorskip("build", reason="python -m build is in the test extra: pip install -e '.[test]'")
    source, dist = tmp_path / "source", tmp_path / "dist"
    shutil.copytree(REPO, source, ignore=lambda folder, names: NOT_SOURCE & set(names) if folder == str(REPO) else ())
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}  # else distutils
    log = run(sys.executable, "-m", "build", "--outdir", dist, source, env=env)          # warns it cannot compile
    assert [line for line in log.splitlines() if "warning" in line.lower()] == []
    [wheel], [sdist] = dist.glob("*.whl"), dist.glob("*.tar.gz")
    yamls = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".yaml")}
    assert {"keel/conf/config.yaml", "keel/conf/model/tiny.yaml", "keel/conf/eval/standard.yaml",
            "keel/evaluation/tasks/standard/keel_arc_easy.yaml",
            "keel/evaluation/tasks/generated/keel_next_line.yaml"} <= yamls
    assert len(yamls) == len(list(REPO.glob("conf/**/*.yaml")) + list(REPO.glob("src/keel/evaluation/tasks/**/*.yaml")))
    with tarfile.open(sdist) as archive:
        assert len([name for name in archive.getnames() if name.endswith(".yaml")]) == len(yamls)

    # A fresh venv with keel from the wheel only; the dependencies (torch, lm-eval, ...) are this interpreter's,
    # through a .pth file (seconds, not a multi-GB install). Its own site-packages comes first on sys.path.
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    [site_packages] = venv.glob("lib/python*/site-packages")
    (site_packages / "deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index",
        "--quiet", wheel)
    here = {"cwd": tmp_path, "env": {**env, "OMP_NUM_THREADS": "1"}}
    location = run(venv / "bin" / "python", "-c", "import keel; print(keel.__file__)", **here)
    assert Path(location.strip()).is_relative_to(site_packages)
    assert "scheme: keel" in run(venv / "bin" / "keel", "pretrain", "--print-config", "model=tiny", **here)
    tasks = run(venv / "bin" / "keel", "eval", "ls", "tasks", **here)
    assert all(name in tasks for name in ("keel_arc_easy", "keel_next_line", "keel_last_token", "arc_easy"))
