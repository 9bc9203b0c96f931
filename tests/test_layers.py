"""The modules form layers: what `d3d.X` names, and who may import whom.

Run: python -m pytest -q tests/test_layers.py
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "__pycache__")]
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == os.path.join(root, "d3d.py"):
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "d3d"
                    and node.attr not in defined
                ):
                    wrong.append(f"{os.path.relpath(path, root)}:{node.lineno} d3d.{node.attr}")
    assert not wrong, wrong


def test_modules_form_layers_without_cycles():
    """runtime <- d3d <- systems/ <- toy <- train.py, decode.py, lab.py: each module imports only
    from the layers below, the drivers never import each other, no import cycle, and no project
    module imports another inside a function, where a cycle would hide (tests aside)."""
    import ast
    import os

    root = ROOT
    modules = {
        name[:-3]: name
        for name in os.listdir(root)
        if name.endswith(".py") and not name.startswith("test_")
    }
    modules |= {
        f"systems.{name[:-3]}": os.path.join("systems", name)
        for name in os.listdir(os.path.join(root, "systems"))
        if name.endswith(".py") and name != "__init__.py"
    }
    allowed = {
        "runtime": set(),
        "d3d": {"runtime"},
        "toy": {"runtime", "systems"},
        "systems": {"runtime", "d3d", "systems"},
        "train": {"runtime", "d3d", "toy", "systems"},
        "decode": {"runtime", "d3d", "toy", "systems"},
        "lab": {"runtime", "d3d", "toy", "systems"},
    }
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
            layer = module.split(".")[0]
            for name in found:
                if name.split(".")[0] not in allowed[layer]:
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
