"""The package on its own: the wheel and the sdist build without a setuptools warning, and the wheel, installed into
a fresh virtual environment away from the source tree, finds its callbacks, conf groups and task YAMLs; an editable
install is setuptools' plain src layout (src/keel/callbacks and src/keel/conf link to the top-level folders), without
its warning about a custom package mapping."""

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


def copy_source(source: Path) -> None:
    """The working tree's project files, its symlinks kept as symlinks (src/keel/callbacks, src/keel/conf)."""
    shutil.copytree(
        REPO, source, symlinks=True, ignore=lambda folder, names: NOT_SOURCE & set(names) if folder == str(REPO) else ()
    )
    assert (source / "src" / "keel" / "callbacks").is_symlink()


def fresh_venv(venv: Path) -> Path:
    """A virtual environment without keel whose dependencies (torch, lm-eval, ...) are this interpreter's, through
    a .pth file (seconds, not a multi-GB install); its own site-packages comes first on sys.path."""
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    [site_packages] = venv.glob("lib/python*/site-packages")
    (site_packages / "deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    return site_packages


def pip_install(venv: Path, *args: str | Path, **kwargs) -> str:
    """pip install into venv, without dependencies (fresh_venv's come from this interpreter)."""
    return run(
        sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", *args, **kwargs
    )


def build_env() -> dict[str, str]:
    """This environment, letting Python write bytecode: with PYTHONDONTWRITEBYTECODE set, building warns that it
    cannot compile."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def run(*command: str | Path, **kwargs) -> str:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


@pytest.mark.slow
def test_wheel_builds_without_warnings_and_runs_from_a_fresh_venv(tmp_path):
    pytest.importorskip("build", reason="python -m build is in the test extra: pip install -e '.[test]'")
    source, dist = tmp_path / "source", tmp_path / "dist"
    copy_source(source)
    env = build_env()
    log = run(sys.executable, "-m", "build", "--outdir", dist, source, env=env)
    assert [line for line in log.splitlines() if "warning" in line.lower()] == []
    [wheel], [sdist] = dist.glob("*.whl"), dist.glob("*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    modules = {f"keel/callbacks/{p.relative_to(REPO / 'callbacks')}" for p in REPO.glob("callbacks/**/*.py")}
    assert {"keel/callbacks/stability.py", "keel/callbacks/options/stability.py"} <= modules <= set(names)
    yamls = {name for name in names if name.endswith(".yaml")}
    assert {
        "keel/conf/config.yaml",
        "keel/conf/model/tiny.yaml",
        "keel/conf/eval/standard.yaml",
        "keel/evaluation/tasks/standard/keel_arc_easy.yaml",
        "keel/evaluation/tasks/generated/keel_next_line.yaml",
    } <= yamls
    assert len(yamls) == len(list(REPO.glob("conf/**/*.yaml")) + list(REPO.glob("src/keel/evaluation/tasks/**/*.yaml")))
    with tarfile.open(sdist) as archive:
        assert len([name for name in archive.getnames() if name.endswith(".yaml")]) == len(yamls)

    venv = tmp_path / "venv"  # with keel from the wheel only
    site_packages = fresh_venv(venv)
    pip_install(venv, "--no-index", "--quiet", wheel)
    here = {"cwd": tmp_path, "env": {**env, "OMP_NUM_THREADS": "1"}}
    location = run(venv / "bin" / "python", "-c", "import keel; print(keel.__file__)", **here)
    assert Path(location.strip()).is_relative_to(site_packages)
    assert "scheme: keel" in run(venv / "bin" / "keel", "pretrain", "--print-config", "model=tiny", **here)
    callbacks = run(venv / "bin" / "python", "-c", "import keel.callbacks.stability as s; print(s.__file__)", **here)
    assert Path(callbacks.strip()).is_relative_to(site_packages)
    tasks = run(venv / "bin" / "keel", "eval", "ls", "tasks", **here)
    assert all(name in tasks for name in ("keel_arc_easy", "keel_next_line", "keel_last_token", "arc_easy"))


@pytest.mark.slow
def test_an_editable_install_is_a_plain_src_layout(tmp_path):
    """setuptools installs the src layout as one path entry, silently; a package-dir mapping the top-level folders
    in would make it say that folders named like the package may take precedence during imports."""
    source, venv = tmp_path / "source", tmp_path / "venv"
    copy_source(source)
    fresh_venv(venv)
    env = build_env()
    log = pip_install(venv, "--verbose", "--editable", source, env=env)
    assert "Editable installation" not in log
    assert [line for line in log.splitlines() if "warning" in line.lower()] == []
    found = run(
        venv / "bin" / "python",
        "-c",
        "import keel.callbacks.options.stability as s, keel.config as c; print(s.__file__); print(c.conf_dir())",
        cwd=tmp_path,
        env=env,
    )
    assert found.split() == [
        str(source / "src" / "keel" / "callbacks" / "options" / "stability.py"),
        str(source / "src" / "keel" / "conf"),
    ]
