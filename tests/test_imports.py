"""The package's import structure: every dependency points one way (no cycle among keel's modules, imports inside
functions and `if TYPE_CHECKING:` blocks included: a circle for types alone is a circle of files all the same), every
module imports on its own in dependency order, and no module imports another's private name."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "src" / "keel"  # keel.callbacks and keel.conf through its symlinks to callbacks/ and conf/


def modules() -> dict[str, Path]:
    found = {}
    for folder, _, names in os.walk(PACKAGE, followlinks=True):
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                parts = [part for part in path.relative_to(PACKAGE).with_suffix("").parts if part != "__init__"]
                found[".".join(["keel", *parts])] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, name) for every `from keel... import name` / `import keel...`, type-only ones included; name is
    None for a plain import. A name that is itself a module counts as that module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("keel"):
            found += [
                (f"{node.module}.{a.name}", None) if f"{node.module}.{a.name}" in known else (node.module, a.name)
                for a in node.names
            ]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith("keel")]
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {module for module, _ in imports(path, known) if module in known and module != name}
        for name, path in known.items()
    }


def test_no_import_cycle():
    try:
        order = list(TopologicalSorter(graph()).static_order())
    except CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None
    assert set(order) == set(modules())


def test_every_module_imports_in_dependency_order():
    order = [name for name in TopologicalSorter(graph()).static_order() if name.split(".")[:2] != ["keel", "conf"]]
    script = f"import importlib\nfor name in {order!r}:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_no_private_name_is_imported_across_modules():
    known = modules()
    private = [
        f"{path.relative_to(ROOT)}: {module}.{name}"
        for path in known.values()
        for module, name in imports(path, known)
        if name and name.startswith("_")
    ]
    private += [
        f"{path.relative_to(ROOT)}: {module}"
        for path in known.values()
        for module, _ in imports(path, known)
        if module.rsplit(".", 1)[-1].startswith("_")
        and module not in {m for m in known if Path(known[m]).parent == path.parent}
    ]
    assert not private, private


# The house, bottom to top (docs/architecture.md): a module imports from its own floor or below, never from above.
# A module is placed by its longest listed prefix; a new module must be placed here.
FLOORS = [
    # torch-free ground: the config (each callback's options with it), errors, and the small rules everyone shares
    [
        "keel",
        "keel.errors",
        "keel.config",
        "keel.callbacks.options",
        "keel.conf",
        "keel.cli_args",
        "keel.artifacts",
        "keel.dirlock",
        "keel.cadence",
        "keel.divergence",
        "keel.provenance",
    ],
    # the model and what is computed from a config alone
    [
        "keel.ops",
        "keel.model",
        "keel.schedule",
        "keel.flops",
        "keel.devices",
        "keel.memory",
        "keel.estimate",
        "keel.decoding",
        "keel.layer_skip",
        "keel.tensor_norms",
        "keel.model_card",
        "keel.trainer_checks",
        "keel.loggers",
        "keel.console",
        "keel.hf",
    ],
    ["keel.data"],
    ["keel.checkpoint", "keel.rundir", "keel.gradflow", "keel.summary"],
    # the training step and what is applied to the model from outside; evaluation of a model
    ["keel.parallel", "keel.strategy", "keel.attention", "keel.lit", "keel.evaluation"],
    ["keel.callbacks"],
    ["keel.training", "keel.pretrain", "keel.generate", "keel.export"],
    # the commands built on training: experiments, bench, gpu-check, and the dispatcher
    ["keel.experiments", "keel.bench", "keel.gpu_check", "keel.cli"],
]


def floor(module: str) -> int:
    prefixes = [
        (len(p), i) for i, names in enumerate(FLOORS) for p in names if module == p or module.startswith(p + ".")
    ]
    assert prefixes, f"{module} has no floor in tests/test_imports.py's FLOORS: place it"
    return max(prefixes)[1]


def test_no_import_runs_back_up_the_house():
    upward = [
        f"{name} (floor {floor(name)}) imports {dep} (floor {floor(dep)})"
        for name, deps in graph().items()
        for dep in sorted(deps)
        if floor(dep) > floor(name)
    ]
    assert not upward, upward
