"""conftest for vLLM's own video-loader tests, pointed at one batchjob loader (scripts/vllm_tests.sh).

scripts/vllm_tests.sh unpacks tests/multimodal from vLLM's source package into a temporary directory and
installs this file there as tests/conftest.py (vLLM's own top-level conftest needs its whole test stack).
The loader under test ($BATCHJOB_SUITE_LOADER) takes the place of vLLM's default `opencv` loader, the one
the tests load by name and that `VideoMediaIO` uses when no backend is named: that is where a user swaps
in our loader. Every test then runs; the ones whose expectations differ by design, or that need what CI
lacks (network), are marked from tests/vllm/EXPECTED_DIFFERENCES.md, each with its reason there.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

LOADER = os.environ["BATCHJOB_SUITE_LOADER"]
DIFFERENCES = Path(os.environ["BATCHJOB_SUITE_DIFFERENCES"])
ROW = re.compile(r"^\|\s*(xfail|skip)\s*\|\s*([^|]+?)\s*\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$")


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
    if LOADER not in VIDEO_LOADER_REGISTRY.name2class:
        raise pytest.UsageError(f"{LOADER!r} is not in vLLM's registry: is batchjob's plugin installed?")
    VIDEO_LOADER_REGISTRY.name2class["opencv"] = VIDEO_LOADER_REGISTRY.name2class[LOADER]


def pytest_report_header(config):
    return f"batchjob loader under test: {LOADER} (registered as vLLM's 'opencv')"


def pytest_collection_modifyitems(config, items):
    rows = expected_differences()
    for item in items:
        for kind, loaders, pattern, reason in rows:
            if ("all" in loaders or LOADER in loaders) and fnmatch.fnmatchcase(item.nodeid, pattern):
                reason = f"[{LOADER}] {reason}"
                item.add_marker(pytest.mark.skip(reason=reason) if kind == "skip"
                                else pytest.mark.xfail(reason=reason, strict=False))
                break
