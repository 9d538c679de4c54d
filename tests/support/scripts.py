"""The repository's ``scripts/``, imported as modules by the tests of their functions.

A script has no ``.py`` suffix, so ``import`` cannot find it: ``load`` reads it from
its path with a source loader instead.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType


def load(path: Path) -> ModuleType:
    """The script at ``path`` executed as a fresh module, named after the file with
    ``-`` as ``_`` (``scripts/fetch-model`` is ``fetch_model``)."""
    name = path.name.replace("-", "_")
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
