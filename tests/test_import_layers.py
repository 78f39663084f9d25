"""r2comm's import layering, read from the source with ast (nothing is imported or run).

Two kinds of contract, each a table below that the next clean-up extends:
- CYCLE_FREE: packages with no import circle among their own modules. Every import counts,
  the ones inside functions too (a lazy import still closes a circle for a reader); an import
  of a submodule does not count as one of its parent packages.
- LEAVES: packages that import nothing of r2comm outside themselves except the modules listed.

Circles through modules outside a package are not claimed by its contract. Over the whole tree,
KNOWN_CIRCLES lists the circles still there (none since the Communicator refactor, issue 30: the
GPU pipeline takes IN_PLACE and the argument checks from args.py); any other circle fails.

TRANSPORT_BLIND: the communicator, the modules under it and the control plane name no transport
kind (issues 30, 43): they ask transport/select.py's JobTransports or the kinds' objects
(r2comm.transport: KINDS, CONTROL, LOCAL), by what they need, and import no kind's module.
(tests/test_layers.py checks the layers themselves, the Cython sources too.)
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CYCLE_FREE = ("r2comm.bench", "r2comm.gpu")
LEAVES = {"r2comm.planner": ("r2comm.errors",)}
KNOWN_CIRCLES = ()
TRANSPORT_BLIND = ("r2comm.communicator", "r2comm.channel", "r2comm.world", "r2comm.events",
                   "r2comm.front.plans", "r2comm.front.railview", "r2comm.front.args",
                   "r2comm.front.p2p", "r2comm.front.pt2pt", "r2comm.front.vcoll",
                   "r2comm.control.facts", "r2comm.control.replan", "r2comm.control.comm_ids",
                   # the control plane asks the kinds' objects (issue 43), by what they offer
                   "r2comm.control.links", "r2comm.control.startup", "r2comm.control.fdlimit",
                   "r2comm.control.liveness", "r2comm.control.tree")
TRANSPORT_OBJECTS = ("r2comm.transport", "r2comm.transport.select", "r2comm.transport.rails")
TRANSPORT_WORDS = ("shm", "verbs")
PUBLIC_NAMES = {("r2comm.communicator", "shm_peers")}     # the public API's own name


def module_files(root, package="r2comm"):
    """{module name: path} of the .py files of PACKAGE under ROOT (a package is its __init__)."""
    found = {}
    base = os.path.join(root, *package.split("."))
    for folder, _, files in os.walk(base):
        rel = os.path.relpath(folder, root).split(os.sep)
        for name in files:
            if name.endswith(".py"):
                parts = rel if name == "__init__.py" else rel + [name[:-3]]
                found[".".join(parts)] = os.path.join(folder, name)
    return found


def _known(name, modules):
    """NAME, or the longest prefix of it that is a module of the tree (None: outside it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node, module, is_package, modules):
    """Modules of the tree that one Import / ImportFrom node of MODULE names."""
    if isinstance(node, ast.Import):
        return [_known(alias.name, modules) for alias in node.names]
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module
    return [_known(f"{base}.{alias.name}", modules) if f"{base}.{alias.name}" in modules
            else _known(base, modules) for alias in node.names]


def import_graph(root=ROOT, package="r2comm"):
    """{module: set of the tree's modules it imports anywhere in its source}."""
    modules = module_files(root, package)
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        graph[module] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for t in _targets(node, module, is_package, modules) if t and t != module}
    return graph


def inside(module, package):
    return module == package or module.startswith(package + ".")


def circles(graph, package):
    """The import circles among PACKAGE's modules: strongly connected components of more than one
    module (Tarjan's algorithm, iterative), each a sorted list."""
    nodes = sorted(m for m in graph if inside(m, package))
    edges = {m: sorted(t for t in graph[m] if inside(t, package)) for m in nodes}
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in nodes:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def outside_imports(graph, package, allowed=()):
    """[(module, imported)] where a module of PACKAGE imports a module of the tree outside it
    that is not in ALLOWED."""
    return sorted((m, t) for m in graph if inside(m, package) for t in graph[m]
                  if not inside(t, package) and t not in allowed)


def test_cycle_free_packages():
    graph = import_graph()
    for package in CYCLE_FREE:
        assert any(inside(m, package) for m in graph), f"{package}: no modules found"
        assert circles(graph, package) == [], f"import circles in {package}"


def test_no_circle_in_the_tree_but_the_known_ones():
    new = [c for c in circles(import_graph(), "r2comm") if c not in KNOWN_CIRCLES]
    assert new == [], "new import circles"


def test_leaves_import_nothing_outside():
    graph = import_graph()
    for package, allowed in LEAVES.items():
        assert any(inside(m, package) for m in graph), f"{package}: no modules found"
        assert outside_imports(graph, package, allowed) == [], f"{package} is not a leaf"


def transport_words(path, module):
    """[(line, name)] of the identifiers (names, attributes, definitions, imports) and comments
    of a module's source that name a transport (TRANSPORT_WORDS), outside PUBLIC_NAMES."""
    with open(path) as f:
        source = f.read()
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
        for name in names:
            if any(w in name.lower() for w in TRANSPORT_WORDS) and \
                    (module, name) not in PUBLIC_NAMES:
                found.append((node.lineno, name))
    for i, line in enumerate(source.splitlines(), 1):
        comment = line.partition("#")[2].lower()
        if any(w in comment for w in TRANSPORT_WORDS):
            found.append((i, "# " + comment.strip()))
    return sorted(found)


def test_front_end_names_no_transport():
    graph = import_graph()
    files = module_files(ROOT)
    for module in TRANSPORT_BLIND:
        assert module in files, f"{module}: not found"
        assert transport_words(files[module], module) == [], f"{module} names a transport"
        bad = sorted(t for t in graph[module] if inside(t, "r2comm.transport")
                     and t not in TRANSPORT_OBJECTS)
        assert bad == [], f"{module} imports transport modules past select"


def _write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_checker_sees_lazy_and_relative_circles(tmp_path):
    """The checker itself: a circle closed by an import inside a function, `from . import x`,
    `from ..x import y` and an absolute import are all found; a one-way chain is not a circle."""
    _write(tmp_path, {
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "def f():\n    from . import b\n    return b\n",
        "pkg/b.py": "from .c import g\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from ..errors import E\nfrom .e import h\n",
        "pkg/sub/e.py": "from pkg.sub import d\n",
        "pkg/errors.py": "class E(Exception):\n    pass\n",
        "pkg/leaf/__init__.py": "from .x import y\n",
        "pkg/leaf/x.py": "from ..errors import E\nfrom ..sub.e import h\ny = 1\n",
    })
    graph = import_graph(str(tmp_path), "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.sub.d"] == {"pkg.errors", "pkg.sub.e"}
    assert circles(graph, "pkg") == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.d", "pkg.sub.e"]]
    assert circles(graph, "pkg.leaf") == []
    assert outside_imports(graph, "pkg.leaf", ("pkg.errors",)) == [("pkg.leaf.x", "pkg.sub.e")]
