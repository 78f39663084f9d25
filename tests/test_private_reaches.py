"""No module of r2comm reads or writes another object's private attribute (issue 30), read from
the source with ast (nothing is imported or run).

A reach is `x._name` where x is not self or cls, and `from module import _name` of an r2comm
module. A module's own privates do not count: a name it defines in a class body (method, class
attribute, __slots__ entry) or assigns on self/cls is its own, so `other._name` of its own class
is fine inside it. Dunder names do not count, nor a package's private submodules imported by
their siblings (`from . import _iproute`). Everything else is a reach, unless listed in ALLOWED
(module, source text) with the reason. r2comm/_core's Cython sources are not Python and not read.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALLOWED = {
    ("r2comm.errors", "exc._r2comm_told"): "errors.py's mark on an exception of any class "
                                           "(exceptions take no weak references)",
    ("r2comm.errors", "exc._r2comm_remote"): "the same, for errors that came from the engine",
    ("r2comm.bench.failover", "os._exit"): "the standard library's exit without clean-up",
    ("r2comm.torch.backend", "pg._get_backend"): "torch's one way to the c10d Backend of a "
                                                 "group torch made itself from ours "
                                                 "(dist.shrink_group's)",
}


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_files(root, package="r2comm"):
    """{module name: path} of the .py files of PACKAGE under ROOT (a package is its __init__)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, *package.split("."))):
        rel = os.path.relpath(folder, root).split(os.sep)
        for name in files:
            if name.endswith(".py"):
                found[".".join(rel if name == "__init__.py" else rel + [name[:-3]])] = \
                    os.path.join(folder, name)
    return found


def _own_names(tree):
    """The private names a module defines for itself: class-body names and __slots__ entries,
    attributes it assigns on self or cls."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else \
                    [item.target] if isinstance(item, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Name):
                        own.add(t.id)
                        if t.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                            own.update(e.value for e in item.value.elts
                                       if isinstance(e, ast.Constant))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
    return own


def _from_r2comm(node, package):
    return node.level > 0 or (node.module or "").split(".")[0] == package


def reaches(source, module, package="r2comm", submodules=()):
    """[(line, text)] of the private reaches in one module's SOURCE (see the module doc);
    submodules: the private modules of the module's own package."""
    tree = ast.parse(source)
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own and \
                not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and _from_r2comm(node, package):
            sibling = node.level == 1 and node.module is None
            for alias in node.names:
                if _private(alias.name) and not (sibling and alias.name in submodules):
                    found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} "
                                               f"import {alias.name}"))
    return sorted(set(found))


def tree_reaches(root=ROOT, package="r2comm"):
    """{(module, text): line} of every private reach in PACKAGE not in ALLOWED."""
    files = module_files(root, package)
    out = {}
    for module, path in files.items():
        pkg = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        subs = {m.rpartition(".")[2] for m in files if m.rpartition(".")[0] == pkg}
        with open(path) as f:
            for line, text in reaches(f.read(), module, package, subs):
                if (module, text) not in ALLOWED:
                    out[(module, text)] = line
    return out


def test_no_module_reads_another_objects_privates():
    found = tree_reaches()
    assert found == {}, "private reaches across modules:\n" + "\n".join(
        f"  {m}:{line}: {text}" for (m, text), line in sorted(found.items()))


def test_allowed_reaches_are_still_there():
    """A listed exception that is gone is struck from ALLOWED (the list stays true)."""
    files = module_files(ROOT)
    seen = set()
    for module, path in files.items():
        with open(path) as f:
            seen |= {(module, t) for _, t in reaches(f.read(), module, submodules=(
                "_iproute",))}
    assert sorted(k for k in ALLOWED if k not in seen) == []


def test_checker_tells_reaches_from_own_privates():
    """The checker itself: reads and writes of another object's private attribute, a private
    name imported from a sibling module and a private attribute of a module are reaches; self,
    cls, the module's own class attributes and slots, dunders, a private submodule and a
    non-r2comm import are not."""
    src = '''
import os
from .other import _helper, public
from . import _sub
from numpy import _private_numpy
class A:
    __slots__ = ("_slot",)
    _flag = 1
    def __init__(self):
        self._mine = 1
    def _meth(self):
        return self._mine
def f(a, comm, mod):
    a._mine, a._slot, a._flag, a._meth()          # the module's own
    comm.__class__, cls_free = None, None
    x = comm._seq                                  # a read of another's private
    comm._world.closed = True                      # and a write
    return mod._cache, os._exit
'''
    got = sorted(t for _, t in reaches(src, "r2comm.m", submodules={"_sub"}))
    assert got == ["comm._seq", "comm._world", "from .other import _helper", "mod._cache",
                   "os._exit"]


def _chan_uses(path):
    """The attributes communicator.py and its two parts (front/pt2pt.py, front/vcoll.py) use
    on the Channel they hold: self._chan.<name>."""
    used = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "_chan" and isinstance(node.value.value, ast.Name) and \
                node.value.value.id == "self":
            used.add(node.attr)
    return used


def test_communicator_holds_its_channel_and_uses_its_interface_only():
    """Issue 43: the Communicator is not a Channel (composition, not a subclass), and what it
    and its parts ask of the Channel it holds is the Channel's public interface."""
    from r2comm.channel import Channel
    from r2comm.communicator import Communicator
    assert not issubclass(Communicator, Channel)
    used = set()
    for rel in ("communicator.py", "front/pt2pt.py", "front/vcoll.py"):
        used |= _chan_uses(os.path.join(ROOT, "r2comm", rel))
    assert {"start", "check", "tell_peers", "message"} <= used, used   # the checker sees them
    for name in sorted(used):
        assert not name.startswith("_"), f"Communicator reads Channel.{name}"
        assert hasattr(Channel, name), f"Channel has no {name}"
