"""The layer rule the parent side rests on: importing a parent-side module never imports torch.

The parent (CLI, matrix, launcher, reports, watch's own side, the pytest plugin's session side)
starts in well under a second and runs on machines without torch; ranks and watched processes
import torch. The modules that may import torch at import time are listed here, and nowhere
else can a module start to: a new module is parent-side until it is added to TORCH_SIDE.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import repro
from conftest import REPO

# Rank-side and diagnosis modules: they run where the graphs are (a rank, a watched process).
TORCH_SIDE = {
    "repro.rank.dist",
    "repro.rank.graphs",
    "repro.diagnose.fingerprint",
    "repro.diagnose.guard",
    "repro.diagnose.owners",
    "repro.diagnose.sites",
    "repro.diagnose.stability",
    "repro.guard",
    "repro.stability",  # the public paths of the two above
    "repro.scenarios.compare",
    "repro.scenarios.nvfp4",
    "repro.scenarios.specdec",
    "repro.scenarios.gemma4_mtp",
    "repro.scenarios.gemma4_target",
    "repro.scenarios.nvfp4_moe",
    "repro.scenarios.piecewise_split",
    "repro.scenarios.selftest",
    "repro.scenarios.sleep_wake",
    "repro.scenarios.workspace_grow",
}

# The paths users import, kept as re-exports of the modules in repro/diagnose/; the project itself
# (examples aside: they show what users write) imports the modules where they live.
PUBLIC_SHIMS = {
    "repro.guard": "repro.diagnose.guard",
    "repro.census": "repro.diagnose.census",
    "repro.stability": "repro.diagnose.stability",
}


def all_modules() -> list[str]:
    names = ["repro"]
    for info in pkgutil.walk_packages(repro.__path__, "repro."):
        if not info.name.startswith("repro.watch._site"):  # the sitecustomize runs on import
            names.append(info.name)
    return sorted(names)


PROBE = "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)\nprint('torch' in sys.modules)"


def imports_torch(modules: list[str]) -> bool:
    """Whether importing these modules, in a fresh interpreter, imports torch."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1] == "True"


def test_every_parent_side_module_imports_without_torch():
    parent = [m for m in all_modules() if m not in TORCH_SIDE]
    assert "repro.cli" in parent and "repro.watch.hooks" in parent and len(parent) > 40
    if imports_torch(parent):  # one interpreter for all; on a failure, name them
        culprits = [m for m in parent if imports_torch([m])]
        raise AssertionError(
            f"these parent-side modules import torch: {culprits}; import it inside "
            "the function that needs it, or list the module in TORCH_SIDE if it "
            "runs on the rank side"
        )


def test_the_torch_side_list_names_modules_that_exist():
    assert TORCH_SIDE <= set(all_modules())


# -- every `repro` import and module path resolves ---------------------------------------------
# The CPU suite never runs the GPU paths, and many imports sit inside the functions only they
# call (a rank's census, a watched process's guard): a moved or renamed module would surface
# there first, on a GPU machine. So every import of the project, wherever it sits, is checked
# here against the package as it is.

SOURCES = ("repro", "tests", "benchmarks", "examples")


def python_files() -> list:
    return sorted(p for top in SOURCES for p in (REPO / top).rglob("*.py"))


def in_repo(spec_or_module) -> bool:
    """From this checkout: an editable install of another checkout answers for names this one lacks."""
    origin = getattr(spec_or_module, "origin", None) or getattr(spec_or_module, "__file__", None)
    return origin is not None and Path(origin).resolve().is_relative_to(REPO)


def resolves(module: str, name: str | None = None) -> bool:
    """Whether `module` exists in this checkout and, with name, has it as an attribute or a submodule."""
    import importlib
    import importlib.util
    import types

    try:
        spec = importlib.util.find_spec(module)
        if spec is None or not in_repo(spec):
            return False
        if name is None:
            return True
        value = getattr(importlib.import_module(module), name, None)
        if isinstance(value, types.ModuleType):
            return in_repo(value)
        sub = importlib.util.find_spec(f"{module}.{name}") if value is None else None
        return value is not None or (sub is not None and in_repo(sub))
    except ImportError:
        return False


def module_path(text: str) -> tuple[str, str | None]:
    """ "repro.a.b" -> the module, or its parent and an attribute ("repro.mod.function")."""
    import importlib.util

    head, _, tail = text.partition(":")  # entry-point form module:attr
    if tail:
        return head, tail
    try:
        if importlib.util.find_spec(head) is not None:
            return head, None
    except ImportError:
        pass
    parent, _, attr = head.rpartition(".")
    return parent, attr


def repro_imports(tree) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import of repro, at any depth (functions too)."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "repro"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "repro":
            found += [(node.lineno, node.module, a.name) for a in node.names if a.name != "*"]
    return found


def is_dotted_repro(value) -> bool:
    import re

    return isinstance(value, str) and re.fullmatch(r"repro(\.[A-Za-z_]\w*)+(:\w+)?", value) is not None


def module_strings(tree) -> list[tuple[int, str]]:
    """Strings naming a module or an attribute by path: after "-m" in an argv literal, ScenarioSpec's
    module=, a HOOK-like constant, the package's _LAZY map, the first argument of
    import_module/PackageLoader/resources.files/monkeypatch.setattr."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = node.elts
            found += [
                (b.lineno, b.value)
                for a, b in zip(items, items[1:])
                if isinstance(a, ast.Constant)
                and a.value == "-m"
                and isinstance(b, ast.Constant)
                and is_dotted_repro(b.value)
            ]
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            args = [k.value for k in node.keywords if k.arg == "module"]
            if func in ("import_module", "PackageLoader", "files", "setattr", "patch") and node.args:
                args.append(node.args[0])
            found += [(a.lineno, a.value) for a in args if isinstance(a, ast.Constant) and is_dotted_repro(a.value)]
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and (t.id.endswith("HOOK") or t.id == "_LAZY") for t in node.targets
        ):
            values = node.value.values if isinstance(node.value, ast.Dict) else [node.value]
            found += [(v.lineno, v.value) for v in values if isinstance(v, ast.Constant) and is_dotted_repro(v.value)]
    return found


def file_strings(tree) -> list[tuple[int, str]]:
    """Paths to the package's own files held in strings ("/repro/rank/worker.py": which frames of a
    dumped stack are a rank's entry point), from repro/ on."""
    import ast
    import re

    return [
        (n.lineno, m.group(1))
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
        for m in [re.fullmatch(r"(?:.*/)?(repro/[\w/]+\.py)", n.value)]
        if m
    ]


def code_strings(tree) -> list:
    """Python source held in strings (`python -c` programs of tests and benchmarks), parsed."""
    import ast

    trees = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "repro" in node.value
            and "import" in node.value
        ):
            try:
                trees.append((node.lineno, ast.parse(node.value)))
            except SyntaxError:
                continue  # prose that names an import, or a fragment of a program
    return trees


def unresolved(path) -> list[str]:
    import ast

    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(REPO)
    bad = [
        f"{where}:{line}: {'from ' + m + ' import ' + n if n else 'import ' + m}"
        for line, m, n in repro_imports(tree)
        if not resolves(m, n)
    ]
    if where.parts[0] != "examples":
        bad += [
            f"{where}:{line}: imports the public path {m}{'.' + n if n else ''}: import {PUBLIC_SHIMS[shim]}"
            for line, m, n in repro_imports(tree)
            for shim in [m if m in PUBLIC_SHIMS else f"{m}.{n}"]
            if shim in PUBLIC_SHIMS
        ]
    bad += [
        f"{where}:{line}: module path {text!r}"
        for line, text in module_strings(tree)
        if not resolves(*module_path(text))
    ]
    bad += [f"{where}:{line}: file path {text!r}" for line, text in file_strings(tree) if not (REPO / text).is_file()]
    for line, inner in code_strings(tree):
        bad += [
            f"{where}:{line}: in a code string: {'from ' + m + ' import ' + n if n else 'import ' + m}"
            for _, m, n in repro_imports(inner)
            if not resolves(m, n)
        ]
    return bad


def test_every_repro_import_and_module_path_resolves():
    files = python_files()
    assert len(files) > 100
    bad = [b for path in files for b in unresolved(path)]
    assert not bad, "imports or module paths that name nothing:\n" + "\n".join(bad)


def test_the_resolution_check_sees_what_it_should(tmp_path):
    """The check itself: imports inside functions, from-import names, -m argv, module=, code strings."""
    probe = tmp_path / "probe.py"
    # Written with PKG for the package, so this file's own check does not read the probe as code.
    probe.write_text(
        "def f():\n    from PKG.no_such import x\n    from PKG.outcome import NoSuchName\n"
        "    from PKG import outcome\n"
        "cmd = ['python', '-m', 'PKG.no_worker']\nSPEC = dict(module='PKG.scenarios.no_such')\n"
        "HOOK = 'PKG.outcome.no_hook'\nCODE = 'from PKG import no_such_module; print(1)'\n".replace("PKG", "repro")
    )
    tree = __import__("ast").parse(probe.read_text())
    assert [m for _, m, _ in repro_imports(tree)] == ["repro.no_such", "repro.outcome", "repro"]
    assert not resolves("repro.no_such") and not resolves("repro.outcome", "NoSuchName")
    assert resolves("repro", "outcome") and resolves("repro.outcome", "Outcome")
    assert sorted(t for _, t in module_strings(tree)) == [
        "repro.no_worker",
        "repro.outcome.no_hook",
        "repro.scenarios.no_such",
    ]
    assert not any(resolves(*module_path(t)) for _, t in module_strings(tree))
    assert [m for _, inner in code_strings(tree) for _, m, _ in repro_imports(inner)] == ["repro"]
    assert not resolves("repro", "no_such_module")
    paths = __import__("ast").parse(
        "WORKER = '/x/PKG/rank/worker.py'\nOLD = '/PKG/worker.py'\nX = 'a/b.py'".replace("PKG", "repro")
    )
    assert [t.replace("repro", "PKG") for _, t in file_strings(paths)] == ["PKG/rank/worker.py", "PKG/worker.py"]


def test_the_public_paths_re_export_everything_public():
    import importlib

    for shim, module in PUBLIC_SHIMS.items():
        old, new = importlib.import_module(shim), importlib.import_module(module)
        public = [n for n in dir(new) if not n.startswith("_")]
        assert public and all(getattr(old, n) is getattr(new, n) for n in public), shim
    assert {"CaptureGuard", "StaleCaptureError"} <= set(dir(importlib.import_module("repro.guard")))
    assert {"CensusBook", "PoolMap"} <= set(dir(importlib.import_module("repro.census")))
    assert repro.expect_stable is importlib.import_module("repro.stability").expect_stable


# -- imports that would point the wrong way ------------------------------------------------------
# The trial parent's runner needs the inventory, not the doctor's tables (rich at import); where
# run folders go needs nothing of the launcher; torch's facts need nothing of the guard. Checked in
# the source, at any depth: a lazy import inside a function points the same way.
WRONG_WAY = {
    "repro/run/runner.py": {"rich", "repro.env.doctor"},
    "repro/env/inventory.py": {"rich", "torch"},
    "repro/run/runs.py": {"repro.run.launch"},
    "repro/env/runtime.py": {"repro.diagnose.guard"},
}


def imported_modules(path) -> set[str]:
    """Every module a file imports, and each of its parents (a.b.c: a, a.b, a.b.c), at any depth."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}


def test_no_import_points_the_wrong_way():
    bad = {path: sorted(unwanted & imported_modules(REPO / path)) for path, unwanted in WRONG_WAY.items()}
    assert not any(bad.values()), bad
