"""Optional third-party packages that megatron-core imports eagerly and training seldom uses, loaded at
their first use instead.

megatron-core 0.16 runs `import wandb` while it is imported, in three modules a training run never calls
into for logging (its inference engine and context, its timers' optional wandb writer). wandb's import
(pydantic models, protobuf, its settings) is about 1 s of every process that imports megatron-core, on every
rank, though only the main rank logs to wandb and only when `logging.wandb` is not `disabled`
(`training/metrics.py` imports it then). With a module loaded at first use, `import wandb` still succeeds
wherever wandb is installed, so megatron-core's `HAVE_WANDB` checks read the same, and the first read of a
name the package defines (megatron's or ours, e.g. `wandb.init`) runs the real import. Nothing in wandb is
changed.

Not the standard library's `importlib.util.LazyLoader`: its module loads at the first read of any
attribute, and `inspect.getmodule` reads `__file__` of every module in `sys.modules` (torch does so while
it registers its custom ops), which would load wandb at once. Here the attributes the import system sets
(`__file__`, `__spec__`, ...) are plain attributes; only `__path__` is held back, so that importing a
submodule (`import wandb.sdk`) runs the package's `__init__` first, as a normal import does.

Like the import hook of `cpu_shims`, this must be in place before the first `import megatron.core`:
`grt_megatron`'s `__init__` calls it. It imports no third-party module itself.
"""

from __future__ import annotations

import importlib.util
import sys
import types

LAZY_PACKAGES = ("wandb",)


class _LoadedAtFirstUse(types.ModuleType):
    def __getattr__(self, attr):  # only for names the module does not have: the package's own
        spec = self.__spec__
        self.__class__ = types.ModuleType  # from here on a plain module, as after a normal import
        if spec.submodule_search_locations is not None:
            self.__path__ = spec.submodule_search_locations
        try:
            spec.loader.exec_module(self)
        except BaseException:
            # As a failed import: the next `import` tries again (and raises the same error there).
            if sys.modules.get(spec.name) is self:
                del sys.modules[spec.name]
            raise
        return getattr(self, attr)


def load_at_first_use(name: str) -> bool:
    """Make `import name` return a module that runs its real import at the first read of a name it
    defines. Does nothing (returns False) if the package is imported already or not installed."""
    if name in sys.modules:
        return False
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return False
    module = importlib.util.module_from_spec(spec)
    module.__dict__.pop("__path__", None)
    module.__class__ = _LoadedAtFirstUse
    sys.modules[name] = module
    return True


def defer_optional_imports() -> list[str]:
    """`load_at_first_use` for each of LAZY_PACKAGES; returns those it made lazy."""
    return [name for name in LAZY_PACKAGES if load_at_first_use(name)]
