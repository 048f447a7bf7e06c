"""Loaders registered by name, shaped like vLLM's `VIDEO_LOADER_REGISTRY`.

A loader is a class with two classmethods, `load_bytes(data, *, num_frames, **kwargs)` and
`load_path(path, *, num_frames, **kwargs)`, each returning `(frames, metadata)`. The path entry exists
because PyAV can open and seek a file directly; reading a 600 s clip into memory just to seek in it
would cost more than the keyframe decode itself.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

import numpy as np

from batchjob.loaders.errors import InvalidArgument


class VideoLoader(Protocol):
    @classmethod
    def load_bytes(cls, data: bytes, *, num_frames: int, **kwargs) -> tuple[np.ndarray, dict]: ...

    @classmethod
    def load_path(cls, path: str, *, num_frames: int, **kwargs) -> tuple[np.ndarray, dict]: ...


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
