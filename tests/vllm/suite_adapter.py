"""conftest for vLLM's own video-loader tests, pointed at batchjob's loaders (scripts/vllm_tests.sh).

scripts/vllm_tests.sh unpacks tests/multimodal from vLLM's source package into a temporary directory and
installs this file there as tests/conftest.py (vLLM's own top-level conftest needs its whole test stack).
Every test runs once per loader in $BATCHJOB_SUITE_LOADERS (default: all four), with that loader in the
place of vLLM's default `opencv` loader: the one the tests load by name and that `VideoMediaIO` uses when
no backend is named, i.e. where a user swaps in our loader. One session for all loaders: vLLM is
imported once. Tests whose expectations differ by design, or that need what CI lacks (network), are
marked from tests/vllm/EXPECTED_DIFFERENCES.md, each with its reason there.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

LOADERS = os.environ.get("BATCHJOB_SUITE_LOADERS", "pyav_keyframes pyav_adaptive pyav_burst batchjob_opencv").split()
DIFFERENCES = Path(os.environ["BATCHJOB_SUITE_DIFFERENCES"])
ROW = re.compile(r"^\|\s*(xfail|skip|once)\s*\|\s*([^|]+?)\s*\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$")
_vllm_default: dict[str, type] = {}


def expected_differences() -> list[tuple[str, set[str], str, str]]:
    """(kind, loaders, test-id pattern, reason) for each table row of EXPECTED_DIFFERENCES.md."""
    rows = []
    for line in DIFFERENCES.read_text().splitlines():
        match = ROW.match(line)
        if match:
            kind, loaders, pattern, reason = match.groups()
            rows.append((kind, {name.strip().strip("`") for name in loaders.split(",")}, pattern, reason))
    if not rows:
        raise RuntimeError(f"{DIFFERENCES} lists no expected differences: is the table intact?")
    return rows


def pytest_configure(config):
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does: our entry point registers the loaders
    missing = [name for name in LOADERS if name not in VIDEO_LOADER_REGISTRY.name2class]
    if missing:
        raise pytest.UsageError(f"{missing} not in vLLM's registry: is batchjob's plugin installed?")
    _vllm_default["opencv"] = VIDEO_LOADER_REGISTRY.name2class["opencv"]


def pytest_report_header(config):
    return f"batchjob loaders under test, each in the place of vLLM's 'opencv': {', '.join(LOADERS)}"


def pytest_generate_tests(metafunc):
    if "batchjob_loader" in metafunc.fixturenames:
        metafunc.parametrize("batchjob_loader", LOADERS, indirect=True)


@pytest.fixture(autouse=True)
def batchjob_loader(request):
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    name = request.param
    VIDEO_LOADER_REGISTRY.name2class["opencv"] = VIDEO_LOADER_REGISTRY.name2class[name]
    yield name
    VIDEO_LOADER_REGISTRY.name2class["opencv"] = _vllm_default["opencv"]


def pytest_collection_modifyitems(config, items):
    rows = expected_differences()
    kept, dropped = [], []
    for item in items:
        loader = item.callspec.params["batchjob_loader"]
        for kind, loaders, pattern, reason in rows:
            if ("all" in loaders or loader in loaders) and fnmatch.fnmatchcase(item.nodeid, pattern):
                if kind == "once":  # never looks up vLLM's default loader: one run is enough
                    (kept if loader == LOADERS[0] else dropped).append(item)
                    break
                reason = f"[{loader}] {reason}"
                item.add_marker(pytest.mark.skip(reason=reason) if kind == "skip"
                                else pytest.mark.xfail(reason=reason, strict=False))
                kept.append(item)
                break
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
