"""The benchmarks import one another without a circle, by their full names (`benchmarks.<kind>.<module>`, the
repository root on the path), so that the walk of tests/test_imports.py sees every edge."""

import ast

from tests.helpers import ROOT
from tests.test_imports import cycles, import_graph

SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))


def test_every_benchmark_imports_the_others_by_their_full_names():
    bare = {path.stem for path in SCRIPTS}
    flat = {}
    for path in SCRIPTS:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            flat.update({f"{path.relative_to(ROOT)}: {name}": True for name in names if name.split(".")[0] in bare})
    assert len(SCRIPTS) > 25 and flat == {}


def test_no_benchmark_imports_itself_through_others():
    graph = import_graph(packages=("benchmarks",))
    assert "benchmarks.gpu_check.gpu_check_record" in graph["benchmarks.gpu_check.tp_check"]
    assert "benchmarks.speed.attention_bench" in graph["benchmarks.gpu_check.gpu_check_decode"]  # a deferred one
    assert cycles(graph) == []
