"""The package's layering rules, checked on its source: no module imports a layer above its own, and no module
reaches into another's private names.

A private name (one leading underscore) is an implementation detail of the module or class that defines it. These
tests parse every module under ``src/exactspec`` and fail on (1) an import of another module's private name and
(2) a private attribute read through anything but ``self``, ``cls``, ``super()`` (hooks a subclass overrides) or a
parameter annotated with the enclosing class (one object copying another of its own kind).
"""

from __future__ import annotations

import ast
from pathlib import Path

import exactspec

PACKAGE = Path(exactspec.__file__).parent


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(path.relative_to(PACKAGE)), ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules) -> list[str]:
    found = []
    for name, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("exactspec")):
                found += [
                    f"{name}:{node.lineno} imports {alias.name} from {'.' * node.level}{node.module or ''}"
                    for alias in node.names
                    if _private(alias.name)
                ]
    return found


def _same_class_parameters(cls: ast.ClassDef, function: ast.FunctionDef) -> set[str]:
    names = set()
    for arg in function.args.args + function.args.kwonlyargs:
        annotation = arg.annotation
        text = annotation.value if isinstance(annotation, ast.Constant) else getattr(annotation, "id", None)
        if text == cls.name:
            names.add(arg.arg)
    return names


def private_attribute_reads(modules) -> list[str]:
    found = []
    for name, tree in modules:
        owners: dict[int, set[str]] = {}  # id of an Attribute node -> names it may read privately through
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for function in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
                allowed = {"self", "cls"} | _same_class_parameters(cls, function)
                for node in ast.walk(function):
                    owners[id(node)] = allowed
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in owners.get(id(node), set()):
                continue
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
                continue
            if ast.unparse(value).startswith("torch.ops"):  # torch's own operator namespace
                continue
            found.append(f"{name}:{node.lineno} reads {ast.unparse(node)}")
    return found


# Lowest first. A module may import its own layer and those below; the package root (exactspec/__init__.py, which
# holds __version__) is importable from anywhere. decoding/ and proposers/ share a layer: a proposer builds q with
# the one sampling pipeline, and the engine drives proposers through their protocol.
LAYERS = (
    {"cache_files", "models", "vocab", "tokenizer", "chat", "version"},
    {"decoding", "proposers"},
    {"loading"},
    {"tuning"},
    {"speculator"},
    {"jobs", "bench", "certification", "training", "serving"},
    {"cli", "__main__", "launch"},
)
# Imports allowed to climb, as (module path, imported module): none today.
CLIMBS_ALLOWED: set[tuple[str, str]] = set()


def _layer(module: str) -> int | None:
    """The layer of a dotted module name or a path under the package (None: the package root)."""
    parts = module.replace("/", ".").removesuffix(".py").split(".")
    top = parts[1] if parts[0] == "exactspec" else parts[0]
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def upward_imports(modules) -> list[str]:
    found = []
    for name, tree in modules:
        own = _layer(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("exactspec."):
                target = _layer(node.module)
                if (
                    own is not None
                    and target is not None
                    and target > own
                    and (name, node.module) not in CLIMBS_ALLOWED
                ):
                    found.append(f"{name}:{node.lineno} imports {node.module} from a layer above")
    return found


def test_every_module_has_a_layer_and_none_imports_upward():
    modules = _modules()
    assert [name for name, _ in modules if _layer(name) is None] == ["__init__.py"]
    assert upward_imports(modules) == []


def test_no_module_imports_another_modules_private_name():
    assert private_imports(_modules()) == []


def test_no_object_reads_another_objects_private_attribute():
    assert private_attribute_reads(_modules()) == []


def test_the_checks_catch_a_reach_in():
    """Power: each rule fails on a module that breaks it, and passes the allowed forms."""
    broken = ast.parse(
        "from exactspec.loading import _hidden\n"
        "class Cache:\n"
        "    def copy(self, other: 'Cache', foreign):\n"
        "        self._k = other._k\n"  # allowed: same class
        "        return foreign._k\n"  # not allowed
    )
    assert private_imports([("x.py", broken)]) == ["x.py:1 imports _hidden from exactspec.loading"]
    relative = ast.parse("from .gguf import GGUFFile, _fields\n")  # a package-relative import counts too
    assert private_imports([("models/x.py", relative)]) == ["models/x.py:1 imports _fields from .gguf"]
    assert private_attribute_reads([("x.py", broken)]) == ["x.py:5 reads foreign._k"]
    climbing = ast.parse(
        "from exactspec.decoding.sampling import block_probs\nfrom exactspec.serving.api import build_app\n"
    )
    assert upward_imports([("decoding/engine.py", climbing)]) == [
        "decoding/engine.py:2 imports exactspec.serving.api from a layer above"
    ]
