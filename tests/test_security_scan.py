"""No code-executing deserialisation or dynamic code anywhere in the package source.

Bytes cross process boundaries here (gRPC, shared memory, Redis frames, checkpoints), so the
source of prefixcache/ and services/ is parsed with `ast` and fails on:
- importing pickle, cPickle, _pickle, cloudpickle, dill, marshal, shelve or joblib;
- `torch.load(...)` without `weights_only=True`; `numpy.load(..., allow_pickle=True)`;
  `yaml.load(...)` / `yaml.load_all(...)` without a safe loader; `pandas.read_pickle`;
- the builtins `eval`, `exec`, `compile`, `__import__`;
- `trust_remote_code=True` (code from a checkpoint directory) in any call.
Aliases (`import torch as t`, `from yaml import load`) are followed. The scanner itself is
tested on snippets that must and must not be flagged, so a scan that finds nothing means
something.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("prefixcache", "services")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _name_of(node: ast.expr | None) -> str:
    """`yaml.SafeLoader` -> "SafeLoader", `SafeLoader` -> "SafeLoader", anything else -> ""."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.findings: list[Finding] = []
        self.modules: dict[str, str] = {}  # local name -> module ("t" -> "torch")
        self.functions: dict[str, str] = {}  # local name -> "module.function" ("load" -> "yaml.load")

    def _flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            root = alias.name.split(".")[0]
            if root in FORBIDDEN_MODULES:
                self._flag(node, f"import {alias.name}")
            self.modules[alias.asname or root] = alias.name if alias.asname else root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] in FORBIDDEN_MODULES:
            self._flag(node, f"from {module} import ...")
        for alias in node.names:
            if alias.name in FORBIDDEN_MODULES:
                self._flag(node, f"from {module} import {alias.name}")
            self.functions[alias.asname or alias.name] = f"{module}.{alias.name}"

    def _qualified(self, func: ast.expr) -> str:
        """ "torch.load" for `torch.load`, `t.load` (import torch as t) or `load` (from torch import load)."""
        if isinstance(func, ast.Name):
            return self.functions.get(func.id, func.id)
        if isinstance(func, ast.Attribute):
            base = func.value
            if isinstance(base, ast.Name):
                return f"{self.modules.get(base.id, self.functions.get(base.id, base.id))}.{func.attr}"
            if isinstance(base, ast.Attribute):
                return f"{self._qualified(base)}.{func.attr}"
        return ""

    def visit_Call(self, node: ast.Call) -> None:
        name = self._qualified(node.func)
        if isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_BUILTINS and name == node.func.id:
            self._flag(node, f"{node.func.id}()")
        if name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            self._flag(node, "torch.load without weights_only=True")
        if name in ("numpy.load", "np.load") and _is_true(_keyword(node, "allow_pickle")):
            self._flag(node, "numpy.load(allow_pickle=True)")
        if name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if _name_of(loader) not in SAFE_YAML_LOADERS:
                self._flag(node, f"{name} without a safe Loader")
        if name.endswith("read_pickle"):
            self._flag(node, name)
        if _is_true(_keyword(node, "trust_remote_code")):
            self._flag(node, "trust_remote_code=True")
        self.generic_visit(node)


def scan_source(source: str, path: str = "<snippet>") -> list[Finding]:
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.findings


def package_files() -> list[Path]:
    files = [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]
    return [p for p in files if "__pycache__" not in p.parts]


def test_the_package_has_no_unsafe_deserialisation_or_dynamic_code() -> None:
    files = package_files()
    assert len(files) > 50, "the scan must see the package"
    findings = [f for path in files for f in scan_source(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not findings, "unsafe constructs:\n" + "\n".join(map(str, findings))


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cPickle as p",
        "from marshal import loads",
        "import shelve",
        "import dill.settings",
        "from joblib import load",
        "import torch\ntorch.load(path)",
        "import torch as t\nt.load(path, weights_only=False)",
        "from torch import load\nload(path)",
        "import numpy as np\nnp.load(path, allow_pickle=True)",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.FullLoader)",
        "from yaml import load, Loader\nload(text, Loader)",
        "import pandas as pd\npd.read_pickle(path)",
        "eval('1 + 1')",
        "exec(code)",
        "compile(src, 'f', 'exec')",
        "__import__('os')",
        "AutoModel.from_pretrained(path, trust_remote_code=True)",
    ],
)
def test_the_scanner_flags_each_unsafe_construct(snippet: str) -> None:
    assert len(scan_source(snippet)) >= 1, snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load(path, weights_only=True)",
        "import yaml\nyaml.safe_load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import numpy as np\nnp.load(path)",
        "model.eval()",
        "import json\njson.loads(text)",
        "AutoModel.from_pretrained(path, local_files_only=True)",
        "re.compile(pattern)",
    ],
)
def test_the_scanner_passes_safe_code(snippet: str) -> None:
    assert scan_source(snippet) == [], snippet
