"""kubernetes-asyncio, imported light: the agent's resident memory is a budget.

The generated packages `kubernetes_asyncio.client`, `.client.models` and `.client.api`
import all of their 767 model classes and every API group when first imported: about
35 MB resident, for the dozen names the agent uses (bench/agent.py measured the idle
agent with [kubernetes] at 94 MB, 67 MB with this). Imported before kubernetes-asyncio
(hostagent.cluster.kube does), this module makes those three packages import each generated
name from its own module on first use; the rest of each package's `__init__` runs as
written. The library's own lookups (`getattr(kubernetes_asyncio.client.models, "V1Pod")`
when it deserializes an answer) go through the same path. If the layout ever changes
so that a package is not found as expected, it is imported the usual way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import re
import sys
import types
from collections.abc import Sequence
from typing import Any

PACKAGES = frozenset(
    {"kubernetes_asyncio.client", "kubernetes_asyncio.client.models",
     "kubernetes_asyncio.client.api"}
)
# The generated imports, one a line: `from kubernetes_asyncio.client.models.v1_pod import V1Pod`.
_GENERATED = re.compile(
    r"^from (kubernetes_asyncio\.client\.(?:models|api)\.\w+) import (\w+)[ \t]*$", re.MULTILINE
)


class _LazyPackage(types.ModuleType):
    """A package whose generated names are imported from their modules on first use."""

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("_lazy_names", {}).get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.__dict__.get("_lazy_names", {})})


class _Loader(importlib.abc.Loader):
    def __init__(self, path: str) -> None:
        self.path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _LazyPackage(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        with open(self.path, encoding="utf-8") as f:
            source = f.read()
        module.__dict__["_lazy_names"] = {name: where for where, name in _GENERATED.findall(source)}
        exec(compile(_GENERATED.sub("", source), self.path, "exec"), module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or not spec.origin.endswith("__init__.py"):
            return None
        spec.loader = _Loader(spec.origin)
        return spec


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
