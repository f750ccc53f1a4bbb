"""The one exception of a bad configuration, shared by the model, the layout checks and the run config, and
the helper that finds a signal's exception inside another one."""

from typing import Optional, TypeVar, Union

E = TypeVar("E", bound=BaseException)


class ConfigError(ValueError):
    """A model or run configuration that cannot be built; the message names the field."""


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
