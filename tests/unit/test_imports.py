"""The house's arrows: no import cycle in rayjobs/, models/ or benchmarks/; models/ never imports upward;
rayjobs never imports benchmarks; the leaves (config's helpers, log, plan, rundir, context) stay leaves.

Like Ray's own circular-import test, this reads every import statement (also those inside functions)
with ``ast``, resolves it to a module of ours, and looks for strongly connected components.
Two things are not arrows: ``from pkg import submodule`` depends on the submodule (Python sets up a
package before its submodules anyway), and an import under ``if __name__ == "__main__":`` runs only
when the file is the program (then it is ``__main__``, not the module others import).
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

ROOTS = ("rayjobs", "models", "benchmarks")


def _modules() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, except those under a ``__main__`` guard."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_main_guard(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports."""
    mods = _modules()

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(ours(a.name) for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                deps.add(sub if sub in mods else ours(base))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_models_never_import_rayjobs_or_torch_distributed():
    graph = import_graph()
    upward = {
        m: sorted(d for d in deps if not d.startswith("models")) for m, deps in graph.items() if m.startswith("models")
    }
    assert all(not d for d in upward.values()), upward
    for path in (REPO / "models").glob("*.py"):
        names = [
            a.name if isinstance(n, ast.Import) else n.module or ""
            for n in _imports(ast.parse(path.read_text()))
            for a in n.names
        ]
        assert not [n for n in names if n.startswith("torch.distributed")], path


def test_rayjobs_never_imports_benchmarks():
    graph = import_graph()
    arrows = {
        m: sorted(d for d in deps if d.startswith("benchmarks")) for m, deps in graph.items() if m.startswith("rayjobs")
    }
    assert all(not d for d in arrows.values()), arrows


def test_the_leaves_import_nothing_of_rayjobs_but_errors():
    graph = import_graph()
    for leaf in (
        "rayjobs.log",
        "rayjobs.plan",
        "rayjobs.rundir",
        "rayjobs.context",
        "rayjobs.storage.uri",
        "rayjobs.storage.store",
        "rayjobs.storage.local",
        "rayjobs.errors",
    ):
        assert graph[leaf] <= {"rayjobs.errors"}, (leaf, graph[leaf])


def test_the_worker_never_imports_its_drivers():
    graph = import_graph()
    reach, todo = set(), ["rayjobs.loop"]
    while todo:
        m = todo.pop()
        for d in graph[m]:
            if d not in reach:
                reach.add(d)
                todo.append(d)
    assert not reach & {"rayjobs.train", "rayjobs.tune", "rayjobs.cli", "rayjobs.launch"}, sorted(reach)


def test_the_train_controller_unpickles_its_run_without_importing_torch(tmp_path):
    """What a Ray Train controller receives of a rayjobs run (the backend config, the backend setup
    callback, the scaling policy) unpickles in a fresh process without importing torch: each controller
    imported it for nothing (about 1 s of CPU a run), through Ray's TorchConfig."""
    import subprocess
    import sys

    import ray.cloudpickle as pickle
    from ray.train import ScalingConfig
    from ray.train.v2._internal.callbacks.backend_setup import BackendSetupCallback

    from rayjobs.torch_backend import FixedScalingWithoutAutoscaler, TorchBackend, TorchBackendConfig
    from rayjobs.trainer import Trainer

    trainer = Trainer(lambda config: None, own_local_ray=True, scaling_config=ScalingConfig(num_workers=2))
    config = trainer.backend_config
    assert isinstance(config, TorchBackendConfig) and config.backend == "gloo" and config.backend_cls is TorchBackend
    sent = (config, BackendSetupCallback(config), FixedScalingWithoutAutoscaler(ScalingConfig(num_workers=2)))
    (tmp_path / "sent.pkl").write_bytes(pickle.dumps(sent))
    code = (
        "import pickle, sys; config, callback, policy = pickle.load(open(sys.argv[1], 'rb')); "
        "assert config.backend == 'gloo' and config.to_dict() == {'backend': 'gloo', 'init_method': 'env', 'timeout_s': 1800}; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sent.pkl")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
