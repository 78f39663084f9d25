"""r2comm's layers, stated as data and checked from the source (issue 43): the Python modules
with ast, the Cython sources (.pyx, .pxi, .pxd: their cimports and the Python imports inside
them) line by line; nothing is imported or run.

LAYERS lists every layer's packages and modules and MAY_IMPORT what each may import; a module
belongs to the layer of its longest listed prefix. An import of a layer not in its MAY_IMPORT
(an upward import, or a sideways one such as the planner reaching a transport) fails, unless
EXCEPTIONS lists the edge with its reason. A private reach between packages fails too: importing
`_name` from another package's module, or `alias._name` on a module imported from another
package (a package: r2comm's subpackage, or the root modules together; r2comm._core is a layer
whose name only says that it is no public API).

KIND_BLIND: the control plane asks transports for nothing but their objects (r2comm.transport:
KINDS, CONTROL, LOCAL, offer/decide; rails.py for the addresses): it imports no kind's module."""
import ast
import functools
import os
import re

from test_import_layers import _write       # (the checkers' own tests write small trees alike)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = {   # top to bottom
    "tools": ("r2comm.bench", "r2comm.sim", "r2comm.testbed"),
    "front": ("r2comm", "r2comm.communicator", "r2comm.channel", "r2comm.request", "r2comm.ops",
              "r2comm.world", "r2comm.front", "r2comm.gpu", "r2comm.torch"),
    "control": ("r2comm.control",),
    "planner": ("r2comm.planner",),
    "transport": ("r2comm.transport",),
    "core": ("r2comm._core",),
    "base": ("r2comm.config", "r2comm.errors", "r2comm.faults", "r2comm.events"),
}
BELOW_FRONT = {"control", "planner", "transport", "core", "base"}
MAY_IMPORT = {
    "tools": set(LAYERS),
    "front": {"front"} | BELOW_FRONT,
    "control": {"control", "planner", "transport", "core", "base"},
    "planner": {"planner", "base"},
    "transport": {"transport", "core", "base"},
    "core": {"core", "base"},
    "base": {"base"},
}
EXCEPTIONS = {
    ("r2comm.control.tree", "r2comm.request"):
        "the control tree's receives fill the public Status (a plain record of the front end)",
}
KIND_BLIND = "r2comm.control"
KIND_OBJECTS = ("r2comm.transport", "r2comm.transport.rails")
CYTHON = (".pyx", ".pxi", ".pxd")


@functools.lru_cache(maxsize=None)
def sources(root=ROOT, package="r2comm"):
    """{module name: path} of PACKAGE's .py and Cython files (a package is its __init__; a
    .pxd beside its .pyx is the same module)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, *package.split("."))):
        rel = os.path.relpath(folder, root).split(os.sep)
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext == ".py" or ext in CYTHON:
                mod = ".".join(rel if stem == "__init__" else rel + [stem])
                found.setdefault(mod, []).append(os.path.join(folder, name))
    return found


def layer_of(module):
    best = None
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and \
                    (best is None or len(p) > len(best[1])):
                best = (layer, p)
    return best and best[0]


def packages(root=ROOT, package="r2comm"):
    """The tree's packages (modules that are an __init__)."""
    return {m for m, paths in sources(root, package).items()
            if any(os.path.basename(p).startswith("__init__.") for p in paths)}


def package_of(module, pkgs):
    """r2comm's subpackage that holds module, or "r2comm" for the root modules."""
    top = ".".join(module.split(".")[:2])
    return top if top in pkgs and top != "r2comm" else "r2comm"


def _known(name, modules):
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


_CY_IMPORT = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+c?import\s+\(?([\w\s,*]+)\)?|"
                        r"c?import\s+([\w.]+)(?:\s+as\s+\w+)?)\s*(?:#.*)?$")


def _cython_imports(path):
    """[(line, base, [names])] of a Cython file's imports and cimports (names: [] for a plain
    `import x`), also indented ones; lines inside triple-quoted strings are skipped, comments
    by the anchored pattern."""
    out = []
    quote = None                      # the triple quote of the string a line is inside
    with open(path) as f:
        for i, line in enumerate(f, 1):
            inside = quote is not None
            for q in ('"""', "\'\'\'"):
                if (quote is None or quote == q) and line.count(q) % 2:
                    quote = None if quote == q else q
            if inside or quote is not None:
                continue
            m = _CY_IMPORT.match(line)
            if not m:
                continue
            if m.group(3):
                out.append((i, m.group(3), []))
            else:
                names = [n.strip().split()[0] for n in m.group(2).split(",") if n.strip()]
                out.append((i, m.group(1), names))
    return out


@functools.lru_cache(maxsize=None)
def imports(root=ROOT, package="r2comm"):
    """[(module, line, imported module, imported name or None)] over the tree's Python and
    Cython sources; relative imports resolved; only modules of the tree. (Cached: callers do
    not change it.)"""
    modules = sources(root, package)
    out = []
    for module, paths in modules.items():
        for path in paths:
            is_pkg = os.path.basename(path).startswith("__init__.")
            here = module.split(".") if is_pkg else module.split(".")[:-1]
            if path.endswith(".py"):
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                items = []
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        items += [(node.lineno, a.name, []) for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        base = "." * node.level + (node.module or "")
                        items.append((node.lineno, base, [a.name for a in node.names]))
            else:
                items = _cython_imports(path)
            for line, base, names in items:
                level = len(base) - len(base.lstrip("."))
                if level:
                    parts = here[:len(here) - (level - 1)]
                    base = ".".join(parts + ([base.lstrip(".")] if base.lstrip(".") else []))
                for name in names or [None]:
                    full = f"{base}.{name}" if name else base
                    target = full if full in modules else _known(base, modules)
                    if target and target != module:
                        out.append((module, line, target,
                                    None if full in modules or name is None else name))
    return out


def upward(edges):
    """[(module, line, imported)] of the imports that break MAY_IMPORT (EXCEPTIONS aside)."""
    bad = []
    for module, line, target, _ in edges:
        a, b = layer_of(module), layer_of(target)
        assert a and b, f"{module} or {target} is in no layer: extend LAYERS"
        if b not in MAY_IMPORT[a] and (module, target) not in EXCEPTIONS:
            bad.append((module, line, target))
    return sorted(set(bad))


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def private_reaches(root=ROOT, package="r2comm"):
    """[(module, line, what)]: a private name imported from another package's module, or
    `alias._name` on a module imported from another package (Python sources)."""
    bad = []
    pkgs = packages(root, package)
    for module, line, target, name in imports(root, package):
        if package_of(module, pkgs) != package_of(target, pkgs):
            if name is not None and _private(name):
                bad.append((module, line, f"{target}.{name}"))
            tail = target.rpartition(".")[2]
            if name is None and _private(tail) and target != "r2comm._core":
                bad.append((module, line, target))
    modules = sources(root, package)
    for module, paths in modules.items():
        for path in (p for p in paths if p.endswith(".py")):
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            here = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
            aliases = {}          # local name -> module of another package
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = here[:len(here) - (node.level - 1)]
                        base = ".".join(parts + ([base] if base else []))
                    for a in node.names:
                        full = f"{base}.{a.name}"
                        if full in modules and package_of(full, pkgs) != package_of(module, pkgs):
                            aliases[a.asname or a.name] = full
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname and a.name in modules and \
                                package_of(a.name, pkgs) != package_of(module, pkgs):
                            aliases[a.asname] = a.name
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and _private(node.attr) and \
                        isinstance(node.value, ast.Name) and node.value.id in aliases:
                    bad.append((module, node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return sorted(set(bad))


def test_every_module_is_in_a_layer():
    missing = sorted(m for m in sources() if layer_of(m) is None)
    assert missing == [], "modules in no layer (extend LAYERS)"


def test_no_upward_import():
    edges = imports()
    assert any(m.startswith("r2comm._core.") and t == "r2comm._core.transport"
               for m, _, t, _ in edges), "the Cython cimports were not read"
    assert upward(edges) == []


def test_exceptions_are_still_needed():
    edges = {(m, t) for m, _, t, _ in imports()}
    assert set(EXCEPTIONS) <= edges, "an exception no import needs any more: drop it"


def test_no_private_reach_between_packages():
    assert private_reaches() == []


def test_control_plane_uses_only_the_transport_objects():
    bad = sorted((m, line, t) for m, line, t, _ in imports()
                 if m.startswith(KIND_BLIND + ".") and t.startswith("r2comm.transport")
                 and t not in KIND_OBJECTS)
    assert bad == [], "the control plane imports a transport kind's module"


def test_checker_sees_upward_imports_and_reaches_in_python_and_cython(tmp_path):
    """The checker itself, on a small tree: a planner importing the control plane (Python, in a
    function), a core .pxi cimporting a transport, a .pyx importing the front end, a private
    name and an attribute reach across packages are found; imports downward are not."""
    _write(tmp_path, {
        "r2comm/__init__.py": "",
        "r2comm/errors.py": "",
        "r2comm/planner/__init__.py": "def f():\n    from ..control import links\n",
        "r2comm/control/__init__.py": "",
        "r2comm/control/links.py": "from ..transport import tcp\nfrom ..errors import E\n"
                                   "x = tcp._keys\n",
        "r2comm/transport/__init__.py": "",
        "r2comm/transport/tcp.py": "from .._core import engine\n_keys = {}\n",
        "r2comm/_core/__init__.py": "",
        "r2comm/_core/engine.pyx": '"""\nfrom r2comm.control import links\n"""\n'
                                   "from r2comm._core.wire cimport hdr\n"
                                   "    from r2comm.communicator import C\n",
        "r2comm/_core/wire.pxd": "cdef struct hdr:\n    int a\n",
        "r2comm/_core/tx.pxi": "from r2comm.transport.tcp cimport _x\n",
        "r2comm/communicator.py": "",
    })
    edges = imports(str(tmp_path))
    assert upward(edges) == [
        ("r2comm._core.engine", 5, "r2comm.communicator"),
        ("r2comm._core.tx", 1, "r2comm.transport.tcp"),
        ("r2comm.planner", 2, "r2comm.control.links"),
    ]
    assert private_reaches(str(tmp_path)) == [
        ("r2comm._core.tx", 1, "r2comm.transport.tcp._x"),
        ("r2comm.control.links", 3, "r2comm.transport.tcp._keys"),
    ]


def test_every_public_name_resolves():
    """r2comm's lazy names point at modules by string (r2comm/__init__.py): a module moved
    without its entry there raised ModuleNotFoundError at the first use of PROC_NULL."""
    import r2comm
    for name in r2comm.__all__:
        assert getattr(r2comm, name) is not None, name
