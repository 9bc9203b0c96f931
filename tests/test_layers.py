"""The modules form layers: what `d3d.X` names, and who may import whom.

Run: python -m pytest -q tests/test_layers.py
"""

import os

from project_files import project_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# who may import whom: each layer and the layers below it. Outside a git checkout these names are
# also where the modules are looked for: `name.py`, and the folder systems/
LAYERS = {
    "runtime": set(),
    # the watchers of a decode's rounds: below d3d, which makes them in generate
    "systems.rounds": {"runtime"},
    "d3d": {"runtime", "systems.rounds"},
    "toy": {"runtime", "systems", "systems.rounds"},
    "systems": {"runtime", "d3d", "systems", "systems.rounds"},
    "train": {"runtime", "d3d", "toy", "systems", "systems.rounds"},
    "decode": {"runtime", "d3d", "toy", "systems", "systems.rounds"},
    "lab": {"runtime", "d3d", "toy", "systems", "systems.rounds"},
}


def test_d3d_names_only_what_d3d_defines():
    """`d3d.X` anywhere in the project means X is defined in d3d.py: what d3d.py takes from
    runtime.py is reached as `runtime.X`, so a reader knows which file to open."""
    import ast
    import os

    root = ROOT
    tree = ast.parse(open(os.path.join(root, "d3d.py")).read())
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    defined |= {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    wrong = []
    for path in project_files(".py"):
        if path == "d3d.py":
            continue
        with open(os.path.join(root, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "d3d"
                and node.attr not in defined
            ):
                wrong.append(f"{path}:{node.lineno} d3d.{node.attr}")
    assert not wrong, wrong


def layer_of(module: str) -> str:
    """A module's layer: its own name where LAYERS names it (systems.rounds), else its package's
    or its own (systems.fast -> systems)."""
    if module in LAYERS:
        return module
    return module.split(".")[0]


def test_modules_form_layers_without_cycles():
    """runtime <- systems/rounds.py <- d3d <- systems/ <- toy <- train.py, decode.py, lab.py:
    each module imports only from the layers below, the drivers never import each other, no
    import cycle, and no project module imports another inside a function, where a cycle would
    hide (tests aside)."""
    import ast
    import os

    root, allowed = ROOT, LAYERS
    modules = {}
    for path in project_files(".py", names=allowed):
        folder, _, name = path.rpartition("/")
        if folder == "" and not name.startswith("test_"):
            module = name[:-3]
        elif folder == "systems" and name != "__init__.py":
            module = f"systems.{name[:-3]}"
        else:
            continue
        if module.split(".")[0] in allowed:  # a file with no layer is not a module of these
            modules[module] = path
    graph, wrong = {}, []
    for module, path in modules.items():
        tree = ast.parse(open(os.path.join(root, path)).read())
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            found = {name for name in names if name in modules}
            if not found:
                continue
            graph[module] |= found
            if node.col_offset > 0:
                wrong.append(f"{path}:{node.lineno} imports {sorted(found)} inside a function")
            layer = layer_of(module)
            for name in found:
                if layer_of(name) not in allowed[layer]:
                    wrong.append(f"{path}:{node.lineno} imports {name}, above its layer")
    done, active = set(), []

    def visit(module):
        if module in active:
            wrong.append("import cycle: " + " -> ".join(active[active.index(module) :] + [module]))
        elif module not in done:
            active.append(module)
            for other in sorted(graph[module]):
                visit(other)
            done.add(active.pop())

    for module in sorted(graph):
        visit(module)
    assert {"runtime", "d3d", "train", "decode", "lab", "systems.fast", "systems.batched"} <= set(
        graph
    )
    assert not wrong, wrong
