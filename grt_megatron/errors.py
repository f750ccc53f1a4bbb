"""The one exception of a bad configuration, shared by the model, the layout checks and the run config; the
one exception of a signal that ends a command (`grt-train`, `grt-prepare-data`); and the helper that finds a
signal's exception inside another one."""

import signal
from typing import Optional, TypeVar, Union

E = TypeVar("E", bound=BaseException)


class ConfigError(ValueError):
    """A model or run configuration that cannot be built; the message names the field."""


class Interrupted(BaseException):
    """A signal ended the command (a BaseException, like KeyboardInterrupt, so that it unwinds through every
    `finally` and no `except Exception` on the way swallows it). `where` says what it interrupted."""

    def __init__(self, signum: int, where: str = "set-up"):
        super().__init__(signum, where)
        self.signum = signum
        self.where = where

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def raise_interrupted(signum, frame) -> None:
    """A signal handler that ends the command at once: raises `Interrupted` in the main thread."""
    raise Interrupted(signum)


def raised_from(err: BaseException, kind: Union[type[E], tuple[type[E], ...]]) -> Optional[E]:
    """The first exception of `kind` in `err`'s chain (`err`, then what it was raised from or during).

    A signal handler's exception raised while C code runs can come back wrapped: a SIGTERM that lands while a
    pybind11 extension initialises (`import sentencepiece`) surfaces as `ImportError: initialization failed`
    with the handler's exception as its cause. Read that way it is still the signal, not an import error."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def first_line(err: BaseException) -> str:
    """An exception's message as one line (its first), or its type's name when it has none: what a CLI
    prints of a third-party error (transformers', safetensors') after naming the file."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
