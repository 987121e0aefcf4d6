"""The package's import graph has no cycle and no upward edge between the layers docs/DESIGN.md names,
counting every import: top-level, function-level and TYPE_CHECKING.

Edges go from a module to each loraserve module it names (`from pkg import sub` names `pkg.sub` when
that is a module, else `pkg`). Parent packages' `__init__` files, which Python runs implicitly, are
not edges: a cycle through them would be a cycle through what they import, which is counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import loraserve

ROOT = Path(loraserve.__file__).parent

# docs/DESIGN.md's layers, lowest first: a package imports only from its own layer and those below.
# "" is loraserve/__init__.py (the public facade) and the top-level modules' layer is their own name.
LAYERS: list[set[str]] = [
    # settings, options, errors, value types
    {
        "envs",
        "errors",
        "json_limits",
        "options",
        "option_types",
        "config",
        "cache_config",
        "multimodal_config",
        "structured_output",
        "sampling_params",
        "sampling_tokens",
        "outputs",
        "beam_search",
        "speculative_config",
    },
    {"native"},  # building and loading the C kernels, huge pages
    {"batch"},  # the per-step batch types
    {"multimodal"},  # image sources, decoding, the HF processor, the image-embedding cache
    {"layers"},  # model building blocks and their kernels
    {"lora", "plugins"},
    {"models"},
    {"model_loader"},
    {"engine"},
    {"entrypoints", "demo", ""},
]


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(module: str, path: Path, modules: set[str]) -> set[str]:
    """The loraserve modules `module` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # a submodule, else an attribute of the package's __init__
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return (names & modules) - {module}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {module: imported_modules(module, path, set(modules)) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# The OpenAI server's rooms, lowest first (DESIGN.md): metrics, tool parsers < request handlers < HTTP app < CLI.
OPENAI = "loraserve.entrypoints.openai"
OPENAI_LAYERS: list[set[str]] = [{"metrics", "tool_parsers"}, {"serving"}, {"server"}, {"cli"}]


def layer_of(module: str, package: str = "loraserve") -> str:
    """The layer name of a module of `package`: its sub-package (or "" for the package's own modules)."""
    parts = module[len(package) + 1 :].split(".") if module.startswith(package + ".") else []
    return parts[0] if len(parts) > 1 or (parts and package == "loraserve") else ""


def upward_edges(
    graph: dict[str, set[str]], layers: list[set[str]], package: str = "loraserve"
) -> list[tuple[str, str]]:
    """The imports (importer, imported) within `package` whose target sits in a higher layer than their source."""
    rank = {name: i for i, names in enumerate(layers) for name in names}
    inside = {module for module in graph if module.startswith(package + ".")}
    return sorted(
        (module, target)
        for module in inside
        for target in graph[module] & inside
        if rank[layer_of(target, package)] > rank[layer_of(module, package)]
    )


def test_every_package_has_a_layer() -> None:
    placed = set().union(*LAYERS)
    assert {layer_of(module) for module in import_graph()} <= placed


def test_no_import_points_up_a_layer() -> None:
    graph = import_graph()
    assert "loraserve.batch.forward_batch" in graph and graph["loraserve.models.llama_stack"]
    assert upward_edges(graph, LAYERS) == []


def test_the_openai_server_rooms_import_downward_only() -> None:
    graph = import_graph()
    rooms = {layer_of(module, OPENAI) for module in graph if module.startswith(OPENAI + ".")} - {""}
    assert rooms == set().union(*OPENAI_LAYERS)
    assert upward_edges(graph, OPENAI_LAYERS + [{""}], OPENAI) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        "loraserve.batch.a": {"loraserve.layers.b"},
        "loraserve.layers.b": {"loraserve.batch.c"},
        "loraserve.batch.c": set(),
    }
    assert upward_edges(graph, [{"batch"}, {"layers"}]) == [("loraserve.batch.a", "loraserve.layers.b")]


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "loraserve.lora.manager" in graph and graph["loraserve.lora.manager"]  # the walk sees imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_hidden_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
