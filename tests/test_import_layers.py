"""The package's import structure, read from the source with `ast` (nothing is imported): no module imports
another that imports it back, directly or around a circle, and no module imports one from a layer above its
own (DESIGN.md: server -> engine -> core / worker -> models -> layers / attention -> kernels). Imports inside
functions count too: a cycle hidden in a function is still a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "minivllm"

# Each module's layer: the rank of the longest prefix listed (a package, or one module of it). A module may
# import modules of its own rank or below, never above.
LAYER_RANKS = {
    "minivllm.__main__": 90, "minivllm.cli": 90, "minivllm.router": 90,   # commands and the router
    "minivllm.server": 80,
    "minivllm": 70, "minivllm.engine": 70,          # the package exports LLM and SamplingParams from engine/
    "minivllm.worker": 60,
    "minivllm.spec_decode.draft_model": 60, "minivllm.spec_decode.metadata": 60,   # the runner's side
    "minivllm.core": 50, "minivllm.outputs": 50, "minivllm.config": 50, "minivllm.structured_output": 50,
    "minivllm.spec_decode": 50,                     # the scheduler's side: proposals, config
    "minivllm.quantization.quantizer": 45, "minivllm.quantization.smoothquant": 45,   # offline, load a model
    "minivllm.lora": 60, "minivllm.lora.request": 0,   # the runner's slots; a request's face is plain data
    "minivllm.lora.layers": 30, "minivllm.lora.peft": 30,   # the linear-layer seam, adapter files
    "minivllm.models": 40,
    "minivllm.layers": 30,
    "minivllm.spec_decode.rejection_sampler": 30, "minivllm.spec_decode.seeding": 30,   # used by the sampler
    "minivllm.attention": 20, "minivllm.quantization": 20,
    "minivllm.kernels": 10,
    "minivllm.envs": 0, "minivllm.sampling_params": 0, "minivllm.distributed": 0,
}


def module_files() -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, whether it is a package's __init__)} for every module of the package."""
    modules = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _owning_module(name: str, modules) -> str | None:
    """The module `name` refers to: itself, or for `package.module.attribute` the longest module prefix."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports}, from every import statement anywhere in its file."""
    modules = module_files()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(_owning_module(alias.name, modules) for alias in node.names
                               if alias.name.split(".")[0] == "minivllm")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "minivllm":
                    continue
                for alias in node.names:   # `from package import module` imports that module
                    targets.add(_owning_module(f"{source}.{alias.name}", modules))
        targets.discard(None)
        targets.discard(name)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def layer_rank(module: str) -> int:
    prefix = module
    while prefix not in LAYER_RANKS or (prefix == "minivllm" and module != "minivllm"):
        if "." not in prefix:
            raise AssertionError(f"{module} belongs to no layer: add it or its package to LAYER_RANKS")
        prefix = prefix.rpartition(".")[0]
    return LAYER_RANKS[prefix]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} imports {target}" for module, targets in sorted(graph.items())
            for target in sorted(targets) if layer_rank(target) > layer_rank(module)]


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "minivllm.engine.llm_engine" in graph and "minivllm.kernels.decode_attention" in graph
    assert "minivllm.core.scheduler" in graph["minivllm.engine.llm_engine"]
    assert "minivllm.core.sequence" in graph["minivllm.core.scheduler"]


def test_the_checks_find_a_circle_and_an_upward_import():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = {"minivllm.models.loader": {"minivllm.engine.tokenizer", "minivllm.layers.linear"}}
    assert upward_imports(graph) == ["minivllm.models.loader imports minivllm.engine.tokenizer"]


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "modules importing each other (move the shared piece into a module below both): " + \
        "; ".join(" <-> ".join(cycle) for cycle in cycles)


def test_no_module_imports_a_layer_above_its_own():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_nothing_below_the_engine_knows_the_engine_or_the_server():
    low = ("minivllm.core", "minivllm.worker", "minivllm.models", "minivllm.layers", "minivllm.attention",
           "minivllm.kernels", "minivllm.quantization", "minivllm.spec_decode")
    for module, targets in import_graph().items():
        if module.startswith(low):
            assert not {t for t in targets if t.startswith(("minivllm.engine", "minivllm.server"))}, module
