"""kvrescue's and grader's modules import one another without a circle (a circle makes import order matter and
hides which layer depends on which).

The graph is read statically with `ast`: every `import` and `from ... import` of a module of either package, at the
top of a file or inside a function (a deferred import is still a dependency), each edge to the module itself (not to
the packages around it).
"""

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("kvrescue", "grader")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The modules of `modules` that `path` imports."""
    name, found = module_name(path, root), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found & modules - {name}


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    paths = sorted(p for package in packages for p in (root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    return {module_name(p, root): imported(p, modules, root) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each back edge of a depth-first walk (none: the graph is acyclic)."""
    found, state, path = [], {}, []

    def walk(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return found


def test_the_walk_finds_a_circle_and_reads_every_kind_of_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    graph = import_graph()
    assert "kvrescue.in_process" in graph["kvrescue.runs"]  # from kvrescue import in_process
    assert "kvrescue.engine.runner" in graph["kvrescue.engine.scoring"]  # from kvrescue.engine.runner import
    assert "kvrescue.engine.prm" in graph["kvrescue.engine"]  # a package's own relative or absolute imports
    assert "grader.sandbox" in graph["grader"] and "grader" in graph["kvrescue.decoding"]  # the grader's too


def test_a_circle_through_a_deferred_import_between_packages_is_found(tmp_path):
    """A function-level import that closes a circle across the two packages is one."""
    for package in ("kvrescue", "grader"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "kvrescue" / "errors.py").write_text("from grader import pipeline\n")
    (tmp_path / "grader" / "pipeline.py").write_text("def late():\n    from kvrescue import errors\n")
    assert cycles(import_graph(tmp_path)) == [["grader.pipeline", "kvrescue.errors", "grader.pipeline"]]


def test_no_module_of_kvrescue_or_grader_imports_itself_through_others():
    assert cycles(import_graph()) == []


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_layers_below_the_grid_read_the_cell_plan_never_the_grid_options():
    """The engine, the memory planner, the cell plan and its builder, and the run folders never import
    `kvrescue.grid`, directly or through others: what runs where in a cell reaches them as a `CellPlan`."""
    graph = import_graph()
    below = [m for m in graph if m.startswith(("kvrescue.engine", "kvrescue.outputs"))
             or m in ("kvrescue.memory_plan", "kvrescue.cell_plan", "kvrescue.cell_runners")]
    assert "kvrescue.cell_runners" in below and "kvrescue.outputs.folder" in below
    assert {m: "kvrescue.grid" in reached(graph, m) for m in below} == dict.fromkeys(below, False)


def loaded_by(modules: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `modules` (comma-separated)."""
    return subprocess.run([sys.executable, "-c", f"import sys, {modules}; print(*sorted(sys.modules))"],
                          capture_output=True, text=True, check=True, timeout=120).stdout.split()


def test_the_owners_of_runs_defaults_load_neither_the_grid_nor_the_engine():
    """`run_options` (each concern's options), `sampling_params` and `detect`: the owners of the defaults `kvrescue
    run` shows, read before anything is loaded, load no module of the engine, nor torch, nor the grid."""
    loaded = loaded_by("kvrescue.run_options, kvrescue.sampling_params, kvrescue.detect")
    assert {"kvrescue.run_options", "kvrescue.sampling_params"} <= set(loaded)
    assert [m for m in loaded if m.startswith(("kvrescue.engine", "kvrescue.grid", "torch"))] == []


def test_the_grid_loads_neither_torch_nor_the_engine():
    """The grid checks its evictor and PRM options and builds the cell plans from the torch-free catalogues
    (`evictor_catalogue`, `prm_catalogue`) and `search_settings`: no torch, and no module of the engine, whose
    package loads torch."""
    loaded = loaded_by("kvrescue.grid")
    assert [m for m in loaded if m.startswith(("kvrescue.engine", "torch"))] == []
    assert {"kvrescue.grid", "kvrescue.evictor_catalogue", "kvrescue.prm_catalogue"} <= set(loaded)


def test_only_the_cli_and_the_executors_read_the_grid_options():
    """The modules that import `kvrescue.grid` (the grid's options, the one builder of its cells' and groups' plans):
    the `run` command and its --plan table, the grid's driver (runs: it checks the options and has them resolve `auto`
    from the models, builds the cells and their run folders' configuration, and chooses the executor), and the
    executors that decode its cells (in this process; over Ray, its driver and actor). The rest reads the plans:
    what resolves `auto` (`auto_options`), a group's models (`group_models`) and its memory against its devices
    (`device_plan`) a `cell_plan.GroupPlan`, a cell's decoding (`decoding`) its `CellPlan`, a --tp group
    (`rank_group`, `rank_follower`) the cell; a new reader is a choice made here."""
    graph = import_graph()
    readers = {m for m, imports in graph.items() if "kvrescue.grid" in imports}
    assert readers == {"kvrescue.cli.run_command", "kvrescue.cli.plan_table", "kvrescue.runs", "kvrescue.in_process",
                       "kvrescue.workers", "kvrescue.group_worker"}
    plan_readers = ("kvrescue.auto_options", "kvrescue.group_models", "kvrescue.device_plan", "kvrescue.decoding",
                    "kvrescue.rank_group", "kvrescue.rank_follower")
    assert {m: "kvrescue.grid" in reached(graph, m) for m in plan_readers} == dict.fromkeys(plan_readers, False)
