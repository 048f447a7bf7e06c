"""Clips for the vLLM tests: encoded once per session from batchjob's synthetic catalogue."""

from __future__ import annotations

import os

import pytest

from batchjob.synthetic.clips import CATALOGUE, make_clip


@pytest.fixture(scope="session")
def clips(tmp_path_factory):
    """clips(name) -> (path, None); the second item keeps the shape of tests/loaders' fixture."""
    directory = tmp_path_factory.mktemp("vllm_clips")
    made: dict[str, str] = {}

    def get(name: str):
        if name not in made:
            spec = CATALOGUE[name]
            path = os.path.join(str(directory), f"{name}.{spec['container']}")
            made[name] = make_clip(path, **spec).path
        return made[name], None

    return get
