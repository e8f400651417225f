"""The house: no import circle among the project's modules, and the model package stands without the decoding one."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("modeling_dspark", "generation", "hub_cards")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports, at module level or inside functions; importing ``a.b.c`` also runs
    the ``__init__`` of ``a`` and ``a.b``, so those count as imported too."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets |= {base} | {f"{base}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        edges = set()
        for target in targets:
            parts = target.split(".")
            edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()
        graph[name] = edges - {name} - {p for p in edges if name.startswith(p + ".")}  # a module's own packages are not cycles
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_decoding_serving_and_scheduling_do_not_import_the_model_package():
    """They work on any drafter through its methods (the remote-code payload carries decoding without the package)."""
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith(("generation.decoding", "generation.scheduling", "generation.serving")):
            assert not any(e.startswith("modeling_dspark") for e in edges), (name, sorted(edges))


def test_importing_the_model_package_does_not_import_decoding():
    code = (
        "import sys, modeling_dspark; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'generation')); "
        "modeling_dspark.DSparkConfig(); "
        "print('generation.decoding.hooks' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "False"


def test_default_data_paths_are_the_shared_folders():
    """Modules that moved keep pointing at ``../shared`` and the repository's ``training_data``."""
    from generation.evaluation.prompts import EVAL_DIR
    from modeling_dspark.training.bench_train import DEFAULT_DATA
    from modeling_dspark.training.data import DEFAULT_TRAIN_DIR

    assert EVAL_DIR == ROOT.parent / "shared" / "data" / "eval"
    assert DEFAULT_TRAIN_DIR == ROOT.parent / "shared" / "data" / "train"
    assert DEFAULT_DATA == ROOT / "training_data" / "smollm2_regen.jsonl.gz"
