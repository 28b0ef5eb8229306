"""Print pip constraints pinning every direct dependency of pyproject.toml (core and extras) to its declared
lower bound: `make test-lowest` installs exactly those, so each bound is one a test run has passed with."""

import re
from pathlib import Path

import tomllib

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
for requirement in requirements:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([^,;\s]+)", requirement.split("#")[0].strip())
    if match and match[1] != "keel":
        print(f"{match[1]}=={match[3]}")
