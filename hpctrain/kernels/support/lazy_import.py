"""A module imported when it is first used: how the op files reach numba.cuda and their kernels.

Importing ``numba.cuda`` costs ~0.6 s of CPU (its typing and lowering registries), and every op
file's launchers need it, so a run on the CPU paid it at start-up, once per rank, for kernels it
never launches. :func:`lazy_import` gives a stand-in that imports the module on first attribute
access (a launch, on the GPU or the simulator) and forwards to it from then on. The import goes
through :func:`importlib.import_module`, whose per-module lock makes two threads' first uses
(the communication thread's kernels beside the main thread's) safe: both get the one module.
"""

from __future__ import annotations

import importlib
import types


class LazyModule:
    """Stands in for the module ``name`` until an attribute is read or set; then forwards to it.

    ``sys.modules`` is not touched: ``import name`` elsewhere imports the real module, the same
    object this forwards to."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_module", None)

    def _load(self) -> types.ModuleType:
        module = self._module
        if module is None:
            module = importlib.import_module(self._name)
            object.__setattr__(self, "_module", module)
        return module

    def __getattr__(self, attr):
        return getattr(self._load(), attr)

    def __setattr__(self, attr, value):
        setattr(self._load(), attr, value)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<lazily imported module {self._name!r} ({state})>"


def lazy_import(name: str) -> LazyModule:
    """A stand-in for module ``name`` (absolute) that imports it on first use."""
    return LazyModule(name)
