"""Loaders registered by name, shaped like vLLM's `VIDEO_LOADER_REGISTRY`.

A loader is a class with two classmethods, `load_bytes(data, *, num_frames, **kwargs)` and
`load_path(path, *, num_frames, **kwargs)`, each returning `(frames, metadata)`. The path entry exists
because PyAV can open and seek a file directly; reading a 600 s clip into memory just to seek in it
would cost more than the keyframe decode itself.

A loader also declares, in `options`, the keyword arguments it reads besides `num_frames`. The loaders
themselves accept and ignore any other keyword (vLLM hands every media kwarg to every loader); a job
config is held to the declaration instead, so a misspelt `loader.kwargs` key is an error before the job
starts, not a setting that silently does nothing.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Mapping, Protocol, TypeVar

import numpy as np

from batchjob.loaders.errors import InvalidArgument


class VideoLoader(Protocol):
    @classmethod
    def load_bytes(cls, data: bytes, *, num_frames: int, **kwargs) -> tuple[np.ndarray, dict]: ...

    @classmethod
    def load_path(cls, path: str, *, num_frames: int, **kwargs) -> tuple[np.ndarray, dict]: ...


@dataclasses.dataclass(frozen=True)
class LoaderOption:
    """A keyword argument a loader reads: its type (`float` also takes integers), a lower bound, what it does."""

    kind: type
    help: str
    minimum: float | None = None

    def problem(self, value: Any) -> str | None:
        """Why `value` is not acceptable, or None."""
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        else:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok:
            return f"expected {'a number' if self.kind is float else self.kind.__name__}, got {value!r}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum:g}, got {value!r}"
        return None


def option_problems(loader: type, kwargs: Mapping[str, Any]) -> list[str]:
    """What is wrong with `kwargs` for `loader` ("key: reason" lines); nothing for a loader that declares no
    `options` (a third-party loader: its keywords cannot be checked)."""
    options: Mapping[str, LoaderOption] | None = getattr(loader, "options", None)
    problems = []
    for key, value in kwargs.items():
        if key == "num_frames":
            problems.append(f"{key}: set loader.num_frames instead")
        elif options is None:
            continue
        elif key not in options:
            valid = ", ".join(sorted(options)) or "none"
            problems.append(f"{key}: unknown keyword for this loader (it reads: {valid})")
        elif (why := options[key].problem(value)) is not None:
            problems.append(f"{key}: {why}")
    return problems


def describe_loader(loader: type) -> str:
    """The first paragraph of the loader's docstring, on one line: what `batchjob loaders` prints."""
    paragraph = (loader.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


L = TypeVar("L", bound=type)


class VideoLoaderRegistry:
    """Name -> loader class. Re-registering a name replaces it (module reloads must not fail)."""

    def __init__(self) -> None:
        self._loaders: dict[str, type] = {}

    def register(self, name: str) -> Callable[[L], L]:
        def wrap(cls: L) -> L:
            for method in ("load_bytes", "load_path"):
                if not callable(getattr(cls, method, None)):
                    raise TypeError(f"loader {name!r} ({cls.__name__}) has no {method}() classmethod")
            self._loaders[name] = cls
            return cls

        return wrap

    def load(self, name: str) -> type[VideoLoader]:
        try:
            return self._loaders[name]
        except KeyError:
            raise InvalidArgument(f"backend {name!r}",
                                  f"no such video loader; choose one of {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._loaders)

    def __contains__(self, name: object) -> bool:
        return name in self._loaders


VIDEO_LOADER_REGISTRY = VideoLoaderRegistry()


def get_loader(name: str) -> type[VideoLoader]:
    return VIDEO_LOADER_REGISTRY.load(name)


def list_loaders() -> list[str]:
    return VIDEO_LOADER_REGISTRY.names()
