"""What kvrescue's wheel holds: the product (kvrescue, grader) and nothing that only tests and benchmarks use.

The packages are those setuptools finds with pyproject.toml's own `[tool.setuptools.packages.find]` settings (the
discovery `pip wheel .` runs, without building one); the test kit beside them, `kvrescue_testkit`, is in none of
them, and no product module imports it.
"""

import tomllib

from setuptools import find_namespace_packages

from tests.helpers import ROOT
from tests.test_imports import import_graph

KIT = "kvrescue_testkit"


def wheel_modules() -> set[str]:
    """The modules of the packages setuptools puts in the wheel (namespace packages included, as pyproject's
    `find` does by default)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_namespace_packages(str(ROOT), include=find.get("include", ("*",)), exclude=find.get("exclude", ()))
    return {f"{package}.{path.stem}" for package in packages
            for path in (ROOT / package.replace(".", "/")).glob("*.py")}


def test_the_wheel_holds_the_product_and_none_of_the_test_kit():
    modules = wheel_modules()
    assert {"kvrescue.cli.run_command", "kvrescue.engine.loader", "grader.__init__"} <= modules
    kit = {path.stem for path in (ROOT / KIT).glob("*.py")} - {"__init__"}
    assert {"fake_cuda", "dry_run", "random_checkpoints", "random_tokenizers", "paper_shapes"} <= kit
    assert {m for m in modules if m.split(".")[0] not in ("kvrescue", "grader")} == set()
    assert {m for m in modules if m.rpartition(".")[2] in kit} == set()


def test_no_product_module_imports_the_test_kit():
    graph = import_graph(packages=("kvrescue", "grader", KIT))
    assert "kvrescue.engine.loader" in graph[f"{KIT}.dry_run"]  # the graph sees the kit's imports
    assert {m: sorted(i for i in imports if i.startswith(KIT)) for m, imports in graph.items()
            if not m.startswith(KIT) and any(i.startswith(KIT) for i in imports)} == {}
