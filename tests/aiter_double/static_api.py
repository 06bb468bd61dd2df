"""Reads an aiter package's public API with `ast`, never importing it (the real one needs ROCm).

PackageIndex resolves a dotted public name (`aiter.pa_fwd_asm`, `aiter.tuned_gemm.tgemm.mm`) to the
`def` it names, following re-exports (`from .x import *`, `from .x import name`), classes and module
level instances (`tgemm = TunedGemm()`). scan_calls lists the aiter calls a source file makes;
call_problems says why a call would not bind to a signature.
"""
from __future__ import annotations

import ast
import dataclasses
from functools import cached_property, lru_cache
from pathlib import Path

DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclasses.dataclass(frozen=True)
class Signature:
    """Parameters of a def, `self` dropped for methods."""
    positional: tuple[str, ...]  # positional-only and positional-or-keyword, in order
    keyword_only: tuple[str, ...]
    defaults: dict[str, str]  # parameter -> its default, unparsed
    var_positional: bool
    var_keyword: bool

    @property
    def names(self) -> tuple[str, ...]:
        return self.positional + self.keyword_only

    def describe(self) -> str:
        return ", ".join(f"{n}={self.defaults[n]}" if n in self.defaults else n for n in self.names)


def signature_of(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> Signature:
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = {a.arg: ast.unparse(d) for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)}
    defaults.update({a.arg: ast.unparse(d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    names = [a.arg for a in positional][1 if method else 0:]
    return Signature(tuple(names), tuple(a.arg for a in args.kwonlyargs), defaults,
                     args.vararg is not None, args.kwarg is not None)


def _statements(body: list[ast.stmt]):
    """Top-level statements, with the bodies of if/try blocks flattened in source order."""
    for statement in body:
        if isinstance(statement, ast.If):
            yield from _statements(statement.body)
            yield from _statements(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _statements(statement.body)
            for handler in statement.handlers:
                yield from _statements(handler.body)
            yield from _statements(statement.orelse)
        else:
            yield statement


def _assigned_names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.Assign):
        return [t.id for t in statement.targets if isinstance(t, ast.Name)]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id]
    return []


def _public_methods(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    return [node for node in cls.body if isinstance(node, DEFS) and not node.name.startswith("_")]


@dataclasses.dataclass(frozen=True)
class Binding:
    """What a name is bound to. kind: "function", "class", "instance" (node is its class), "module"
    or "value"; a method is a "function" with its class_name set."""
    kind: str
    module: str
    node: ast.AST | None = None
    class_name: str = ""


class PackageIndex:
    """The public API of one copy of the `aiter` package; `root` is the directory holding `aiter/`."""

    def __init__(self, root: Path, package: str = "aiter"):
        self.root = Path(root)
        self.package = package

    def module_file(self, module: str) -> Path | None:
        path = self.root.joinpath(*module.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
        return path if path.is_dir() else None  # a namespace package (aiter/utility has no __init__)

    @lru_cache(maxsize=None)
    def module_body(self, module: str) -> list[ast.stmt] | None:
        path = self.module_file(module)
        if path is None:
            return None
        return [] if path.is_dir() else list(_statements(ast.parse(path.read_text(), filename=str(path)).body))

    def _inside(self, module: str) -> bool:
        return module == self.package or module.startswith(self.package + ".")

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The absolute module a (possibly relative) `from ... import` in `module` reads."""
        if node.level == 0:
            return node.module or ""
        path = self.module_file(module)
        package = module.split(".")
        if not (path.name == "__init__.py" or path.is_dir()):
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))

    def _star_exports(self, module: str) -> tuple[str, ...] | None:
        """__all__ when it is a literal list, else None (every public name is exported)."""
        for statement in self.module_body(module) or []:
            if "__all__" in _assigned_names(statement):
                try:
                    return tuple(ast.literal_eval(statement.value))
                except ValueError:
                    return None
        return None

    def binding(self, module: str, name: str, seen: frozenset = frozenset()) -> Binding | None:
        """The last top-level binding of `name` in `module`, followed through imports."""
        if (module, name) in seen:
            return None
        seen = seen | {(module, name)}
        for statement in reversed(self.module_body(module) or []):
            found = self._binding_in(statement, module, name, seen)
            if found is not None:
                return found
        return None

    def _binding_in(self, statement: ast.stmt, module: str, name: str, seen: frozenset) -> Binding | None:
        if isinstance(statement, DEFS) and statement.name == name:
            return Binding("function", module, statement)
        if isinstance(statement, ast.ClassDef) and statement.name == name:
            return Binding("class", module, statement)
        if name in _assigned_names(statement):
            value = statement.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                cls = self.binding(module, value.func.id, seen)
                if cls is not None and cls.kind == "class":
                    return Binding("instance", cls.module, cls.node, cls.node.name)
            return Binding("value", module, statement)
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname == name and self._inside(alias.name):
                    return Binding("module", alias.name)
        if isinstance(statement, ast.ImportFrom):
            source = self._absolute(module, statement)
            if not self._inside(source):
                return None
            for alias in statement.names:
                if alias.name == "*":
                    exports = self._star_exports(source)
                    if not name.startswith("_") and (exports is None or name in exports):
                        found = self.binding(source, name, seen)
                        if found is not None:
                            return found
                elif (alias.asname or alias.name) == name:
                    submodule = f"{source}.{alias.name}"
                    return self.binding(source, alias.name, seen) or (
                        Binding("module", submodule) if self.module_file(submodule) else None)
        return None

    def resolve(self, dotted: str) -> Binding | None:
        """`aiter.a.b.c` -> what it names, or None. A submodule resolves even when no import binds it."""
        parts = dotted.split(".")
        if parts[0] != self.package:
            return None
        current = Binding("module", self.package)
        for part in parts[1:]:
            if current.kind == "module":
                found = self.binding(current.module, part)
                if found is None and self.module_file(f"{current.module}.{part}") is not None:
                    found = Binding("module", f"{current.module}.{part}")
            elif current.kind in ("class", "instance"):
                found = next((Binding("function", current.module, node, current.node.name)
                              for node in current.node.body if isinstance(node, DEFS) and node.name == part), None)
            else:
                return None
            if found is None:
                return None
            current = found
        return current

    def signature(self, dotted: str) -> Signature | None:
        found = self.resolve(dotted)
        if found is None or found.kind != "function":
            return None
        return signature_of(found.node, method=bool(found.class_name))

    @cached_property
    def modules(self) -> list[str]:
        """Every module of the package, skipping private ones (a path part starting with `_`)."""
        names = []
        for path in sorted((self.root / self.package).rglob("*.py")):
            parts = path.relative_to(self.root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            if not any(part.startswith("_") for part in parts):
                names.append(".".join(parts))
        return names

    def public_definitions(self) -> dict[str, str]:
        """dotted name -> "function" / "class" / "value" for every public def, class, method (also of a
        module-level instance) and module-level variable the package's own modules define."""
        found = {}
        for module in self.modules:
            for statement in self.module_body(module):
                if isinstance(statement, DEFS) and not statement.name.startswith("_"):
                    found[f"{module}.{statement.name}"] = "function"
                elif isinstance(statement, ast.ClassDef) and not statement.name.startswith("_"):
                    found[f"{module}.{statement.name}"] = "class"
                    for method in _public_methods(statement):
                        found[f"{module}.{statement.name}.{method.name}"] = "function"
                for name in (n for n in _assigned_names(statement) if not n.startswith("_")):
                    found[f"{module}.{name}"] = "value"
                    binding = self.resolve(f"{module}.{name}")
                    if binding is not None and binding.kind == "instance":
                        for method in _public_methods(binding.node):
                            found[f"{module}.{name}.{method.name}"] = "function"
        return found

    def top_level_functions(self) -> list[str]:
        """`aiter.<name>` for every public function the package's __init__ imports or star-imports."""
        names = set()
        for statement in self.module_body(self.package):
            if isinstance(statement, ast.ImportFrom):
                source = self._absolute(self.package, statement)
                for alias in statement.names:
                    if alias.name == "*":
                        exported = self._star_exports(source)
                        names.update(exported if exported is not None else [
                            s.name for s in self.module_body(source) or [] if isinstance(s, DEFS)])
                    else:
                        names.add(alias.asname or alias.name)
        dotted = (f"{self.package}.{n}" for n in names if not n.startswith("_"))
        return sorted(d for d in dotted if (b := self.resolve(d)) is not None and b.kind == "function")


# ------------------------------------------------------------------------------ calls in a source

@dataclasses.dataclass(frozen=True)
class Call:
    path: str
    line: int
    target: str  # the dotted aiter name called
    positional: int
    keywords: tuple[str, ...]
    unpacked: bool  # *args or **kwargs at the call site: the counts are lower bounds

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _aiter_aliases(tree: ast.Module, package: str) -> dict[str, str]:
    """Local name -> dotted aiter name, from every import in the file (in any scope)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    aliases[alias.asname or package] = alias.name if alias.asname else package
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == package or node.module.startswith(package + "."):
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names if a.name != "*"})
    return aliases


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id] + parts[::-1] if isinstance(node, ast.Name) else None


def scan_calls(source: str, path: str, package: str = "aiter") -> list[Call]:
    """Every call of an aiter name in `source`: `aiter.x(...)`, `aiter.sub.x(...)`, or a name bound by
    `from aiter... import x`."""
    tree = ast.parse(source, filename=path)
    aliases = _aiter_aliases(tree, package)
    calls = []
    for node in ast.walk(tree):
        parts = _dotted(node.func) if isinstance(node, ast.Call) else None
        if parts is None or parts[0] not in aliases:
            continue
        unpacked = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        calls.append(Call(path, node.lineno, ".".join([aliases[parts[0]]] + parts[1:]),
                          sum(not isinstance(a, ast.Starred) for a in node.args),
                          tuple(k.arg for k in node.keywords if k.arg is not None), unpacked))
    return sorted(calls, key=lambda c: (c.path, c.line, c.target))


def call_problems(call: Call, signature: Signature) -> list[str]:
    """Why `call` would not bind to `signature` (empty when it binds). An unknown keyword reads
    "keyword 'name'"; other problems are phrased to follow "calls x with"."""
    problems = []
    if call.positional > len(signature.positional) and not signature.var_positional:
        problems.append(f"{call.positional} positional arguments where it takes at most {len(signature.positional)}")
    for keyword in call.keywords:
        if keyword not in signature.names and not signature.var_keyword:
            problems.append(f"keyword {keyword!r}")
        elif keyword in signature.positional[: call.positional]:
            problems.append(f"keyword {keyword!r} for a parameter already passed by position")
    if not call.unpacked:
        given = set(signature.positional[: call.positional]) | set(call.keywords)
        missing = [n for n in signature.names if n not in signature.defaults and n not in given]
        if missing:
            problems.append(f"no value for required {', '.join(missing)}")
    return problems
