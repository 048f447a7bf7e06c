"""Test-environment only: lets the registry's (CUDA) torchvision wheel import beside the CPU torch.

scripts/vllm_env.sh copies this file into the vLLM test environment with a `.pth` line that imports it,
never into the main environment or a user's. torchvision's compiled operators cannot load beside the CPU
torch, and `import torchvision` then dies in `torchvision._meta_registrations`, which registers fake
(meta) kernels for them with `torch.library.register_fake("torchvision::nms")`: "operator torchvision::nms
does not exist". This hook runs that module with those registrations skipped for operators that do not
exist; the pure-PyTorch transforms vLLM's Qwen2-VL processing uses are unaffected. Nothing is imported
at interpreter start: the hook only waits for that one module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "torchvision._meta_registrations"


class _SkipMissingFakes(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import torch

        original = torch.library.register_fake

        def register_fake(op, *args, **kwargs):
            if isinstance(op, str) and op.startswith("torchvision::"):
                try:
                    torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
                except RuntimeError:  # the operator does not exist: nothing to register a fake for
                    return lambda fn: fn
            return original(op, *args, **kwargs)

        torch.library.register_fake = register_fake
        try:
            self._inner.exec_module(module)
        finally:
            torch.library.register_fake = original


if not any(isinstance(finder, _SkipMissingFakes) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SkipMissingFakes())
