"""Shared fixtures for the engine tests: tiny random checkpoints, random clips, a transformers reference."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from batchjob.engine import ClassifyRequest, Clip, EngineConfig
from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

# Two architectures x two shapes: GQA (4 query heads on 2 KV heads) and plain multi-head attention with a
# different head_dim and depth. Each is a few hundred KB and builds in about a second.
SPECS = {
    "qwen2_5_vl-gqa": TinyModelSpec(model_type="qwen2_5_vl", hidden_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, intermediate_size=128, seed=1),
    "qwen2_5_vl-mha": TinyModelSpec(model_type="qwen2_5_vl", hidden_size=96, num_layers=3, num_heads=3,
                                    num_kv_heads=3, intermediate_size=160, vision_depth=3, vision_hidden=48,
                                    vision_heads=3, fullatt_block_indexes=(2,), seed=2),
    "qwen2_vl-gqa": TinyModelSpec(model_type="qwen2_vl", hidden_size=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, intermediate_size=128, seed=3),
    "qwen2_vl-mha": TinyModelSpec(model_type="qwen2_vl", hidden_size=96, num_layers=3, num_heads=3,
                                  num_kv_heads=3, intermediate_size=160, vision_depth=3, vision_hidden=48,
                                  vision_heads=3, seed=4),
    # Qwen3-VL: head_dim 32 with hidden 64 / 4 heads (head_dim != hidden / heads, as in the 4B and 30B-A3B,
    # where mlx-vlm's `head_dim` property is wrong), tied embeddings (as 2B/4B), DeepStack after the first two
    # vision layers; the MoE model is MHA with 3 layers, 4 experts (top 2), DeepStack from layers 1 and 2.
    "qwen3_vl": TinyModelSpec(model_type="qwen3_vl", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=32, intermediate_size=128, deepstack_visual_indexes=(0, 1),
                              tie_word_embeddings=True, seed=11),
    "qwen3_vl_moe": TinyModelSpec(model_type="qwen3_vl_moe", hidden_size=96, num_layers=3, num_heads=3,
                                  num_kv_heads=3, intermediate_size=160, vision_depth=3, vision_hidden=48,
                                  vision_heads=3, deepstack_visual_indexes=(1, 2), moe_intermediate_size=40,
                                  seed=12),
}
PARITY_MAX_PIXELS = 28 * 28 * 48


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """Build (once per session) the tiny checkpoint for a SPECS key."""
    cache: dict[str, str] = {}

    def build(name: str) -> str:
        if name not in cache:
            cache[name] = str(write_tiny_checkpoint(tmp_path_factory.mktemp(name), SPECS[name]))
        return cache[name]

    return build


@pytest.fixture(scope="session")
def tiny_classifier(checkpoint_dir):
    """One loaded Classifier per (checkpoint, frozen settings), shared across tests that do not mutate it."""
    from batchjob.engine import Classifier

    cache: dict = {}

    def get(name: str = "qwen2_5_vl-gqa", **settings):
        key = (name, tuple(sorted(settings.items())))
        if key not in cache:
            config = EngineConfig(**{"max_model_len": 2048, "memory_budget_gb": 1.0, **settings})
            cache[key] = Classifier.from_pretrained(checkpoint_dir(name), config)
        return cache[key]

    return get


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed so a failure can be replayed (ENGINE_TEST_SEED=...)."""
    seed = int(os.environ.get("ENGINE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{request.node.name}: ENGINE_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def _random_clip(rng, media_id: str, *, num_frames: int | None = None, size=None) -> Clip:
    """Random frames plus loader-like metadata with uneven (keyframe-like) source indices."""
    num_frames = num_frames or int(rng.integers(2, 7))
    height, width = size or (int(rng.integers(90, 170)), int(rng.integers(170, 230)))
    frames = rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    fps = float(rng.choice([24.0, 25.0, 30.0]))
    steps = rng.integers(4, 20, num_frames - 1) if num_frames > 1 else []
    indices = np.concatenate([[int(rng.integers(0, 10))], np.cumsum(steps) + 0]).astype(int)
    if num_frames > 1:
        indices[1:] += indices[0]
    metadata = {"fps": fps, "frames_indices": indices.tolist(), "total_num_frames": int(indices[-1]) + 5,
                "duration": (int(indices[-1]) + 5) / fps, "video_backend": "synthetic"}
    return Clip(frames=frames, metadata=metadata, media_id=media_id)


WORDS = "what does the person do next why is red ball moving left right cat dog table before after".split()


def _random_request(rng, request_id: str, clip: Clip, num_options: int | None = None) -> ClassifyRequest:
    question = " ".join(rng.choice(WORDS, int(rng.integers(2, 14)))).capitalize() + "?"
    num_options = num_options or int(rng.integers(2, 6))
    options = tuple(" ".join(rng.choice(WORDS, int(rng.integers(1, 5)))) for _ in range(num_options))
    return ClassifyRequest(request_id=request_id, clip=clip, question=question, options=options)


def _check_choice(result, reference, where="") -> None:
    """The engine's choice is the argmax of its own log-probs, and against a reference computed another way
    (another library, batch or cache state) it may differ only on a near-tie: where the reference's top options
    lie closer than the two computations differ. An exact argmax match fails by chance on random models (their
    options are sometimes within 1e-5 of each other) while the engine is right."""
    ours = np.asarray(result.logprobs, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    assert result.choice == int(np.argmax(ours)), (where, result.choice, ours)
    err = float(np.abs(ours - reference).max())
    assert reference[result.choice] >= reference.max() - 2 * err - 1e-12, (where, result.choice, reference, err)


@pytest.fixture(scope="session")
def check_choice():
    """`check_choice(result, reference_logprobs, where)`: the choice is right up to a near-tie (see above)."""
    return _check_choice


@pytest.fixture(scope="session")
def specs() -> dict[str, TinyModelSpec]:
    return SPECS


@pytest.fixture(scope="session")
def parity_max_pixels() -> int:
    return PARITY_MAX_PIXELS


@pytest.fixture(scope="session")
def make_clip():
    """`make_clip(rng, media_id, num_frames=None, size=None) -> Clip` with random frames and metadata."""
    return _random_clip


@pytest.fixture(scope="session")
def make_request():
    """`make_request(rng, request_id, clip, num_options=None) -> ClassifyRequest` with random text."""
    return _random_request


@pytest.fixture(scope="session")
def mlx_vlm_qwen3_tower():
    """Loads mlx-vlm's Qwen3-VL vision tower as mlx-vlm builds it, with only its GELU swap corrected
    (PLATFORM.md): the reference the engine's planned tower is held to."""
    def load(path: str):
        import mlx.nn as nn
        from mlx_vlm.utils import load_model

        tower = load_model(Path(path)).vision_tower
        for merger in [tower.merger, *tower.deepstack_merger_list]:
            merger.act_fn = nn.GELU()
        for block in tower.blocks:
            block.mlp.act_fn = nn.GELU(approx="tanh")
        return tower

    return load


@pytest.fixture(scope="session")
def wheel_nvrtc():
    """NVRTC from the nvidia-cuda-nvrtc-cu12 wheel (compiles our CUDA sources without a GPU), or a skip."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-cuda-nvrtc-cu12 is not installed (the test extra installs it on Linux x86-64)")
    return ctypes.CDLL(str(Path(list(spec.submodule_search_locations)[0]) / "lib" / "libnvrtc.so.12"))


@pytest.fixture(scope="session")
def nvrtc_output(wheel_nvrtc):
    """`output(source, options, what)`: what the wheel's NVRTC gives for `source` compiled with `options`
    (strings): its log (`what="log"`, e.g. ptxas's report) or its PTX (`what="ptx"`). The compile must succeed."""
    lib = wheel_nvrtc
    getters = {"log": (lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog),
               "ptx": (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)}

    def output(source: str, options: list[str], what: str) -> str:
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None) == 0
        try:
            flags = [o.encode() for o in options]
            assert lib.nvrtcCompileProgram(prog, len(flags), (ctypes.c_char_p * len(flags))(*flags)) == 0
            get_size, get = getters[what]
            size = ctypes.c_size_t()
            get_size(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            get(prog, text)
            return text.value.decode(errors="replace")
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    return output


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """tests/engine/fake_nvidia_smi.py as `nvidia-smi`, first on PATH; returns the file whose content is the
    stream's SM clock (written "1000" here; a test rewrites it between sections)."""
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!{sys.executable}\n" + (Path(__file__).parent / "fake_nvidia_smi.py").read_text())
    tool.chmod(0o755)
    phase = tmp_path / "fake-smi-phase"
    phase.write_text("1000")
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_PHASE", str(phase))
    return phase
