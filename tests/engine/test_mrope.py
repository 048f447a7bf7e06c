"""M-RoPE positions against two independent implementations: transformers' and mlx-vlm's get_rope_index."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from batchjob.engine.mrope import mrope_positions, placeholder_runs, video_temporal_interval

VIDEO, START, END = 90, 91, 92


def _prompt(rng, grid, merge=2):
    n = grid[0] * (grid[1] // merge) * (grid[2] // merge)
    before = rng.integers(0, 80, int(rng.integers(1, 12))).tolist()
    after = rng.integers(0, 80, int(rng.integers(1, 12))).tolist()
    return np.array(before + [START] + [VIDEO] * n + [END] + after)


def _transformers_positions(ids, grid, second_per_grid_t, tokens_per_second):
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(
        spatial_merge_size=2, tokens_per_second=tokens_per_second)))
    fake.get_vision_position_ids = lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(fake, *a, **k)
    input_ids = torch.tensor([ids.tolist()])
    positions, _ = Qwen2_5_VLModel.get_rope_index(
        fake, input_ids, mm_token_type_ids=(input_ids == VIDEO).int() * 2, video_grid_thw=torch.tensor([grid]),
        second_per_grid_ts=torch.tensor([second_per_grid_t], dtype=torch.float32))
    return positions[:, 0].numpy()


def _mlx_vlm_positions(ids, grid):
    import mlx.core as mx
    from mlx_vlm.models.qwen2_vl.language import LanguageModel

    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2),
                                                  image_token_id=89, video_token_id=VIDEO, vision_start_token_id=START))
    positions, _ = LanguageModel.get_rope_index(fake, mx.array([ids.tolist()]), None, mx.array([grid]))
    return np.array(positions[:, 0])


@pytest.mark.parametrize("trial", range(6))
def test_matches_transformers_with_time_scale(trial, rng):
    """Qwen2.5-VL: temporal positions scaled by tokens_per_second * second_per_grid_t (fractional too)."""
    grid = (int(rng.integers(1, 5)), 2 * int(rng.integers(3, 7)), 2 * int(rng.integers(3, 7)))
    spg = float(rng.uniform(0.2, 1.5))
    interval = video_temporal_interval(2, spg)
    # transformers 5.23 continues text after the video at start + max(h, w); that equals the reference
    # rule (max position + 1) exactly when the temporal extent is not the largest.
    if int((grid[0] - 1) * interval) > max(grid[1], grid[2]) // 2 - 1:
        spg = 0.5 * (max(grid[1], grid[2]) // 2 - 1) / max(grid[0] - 1, 1) / 2
        interval = video_temporal_interval(2, spg)
    ids = _prompt(rng, grid)
    ours = mrope_positions(ids, VIDEO, [grid], [interval], 2)
    np.testing.assert_array_equal(ours, _transformers_positions(ids, grid, spg, 2))


@pytest.mark.parametrize("trial", range(6))
def test_matches_mlx_vlm_without_time_scale(trial, rng):
    """Qwen2-VL (step 1): any grid, including clips whose temporal extent is the largest."""
    grid = (int(rng.integers(1, 12)), 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)))
    ids = _prompt(rng, grid)
    ours = mrope_positions(ids, VIDEO, [grid], [video_temporal_interval(None, 99.0)], 2)
    np.testing.assert_array_equal(ours, _mlx_vlm_positions(ids, grid))


def test_hand_example():
    """2 text tokens, a 2x(2x2 merged) video with interval 2.5, 2 text tokens."""
    ids = np.array([1, 2] + [VIDEO] * 8 + [3, 4])
    pos = mrope_positions(ids, VIDEO, [(2, 4, 4)], [2.5], 2)
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:10].tolist() == [2, 2, 2, 2, 4, 4, 4, 4]  # floor(0 * 2.5), floor(1 * 2.5) = 2, + start 2
    assert pos[1, 2:10].tolist() == [2, 2, 3, 3, 2, 2, 3, 3]
    assert pos[2, 2:10].tolist() == [2, 3, 2, 3, 2, 3, 2, 3]
    assert pos[:, 10:].tolist() == [[5, 6]] * 3  # max video position 4, + 1


def test_errors_and_runs():
    ids = np.array([1, VIDEO, VIDEO, 2, VIDEO, 3])
    assert placeholder_runs(ids, VIDEO) == [(1, 3), (4, 5)]
    with pytest.raises(ValueError, match="one grid"):
        mrope_positions(ids, VIDEO, [(1, 2, 2)], [1.0], 2)
    with pytest.raises(ValueError, match="gives 4"):
        mrope_positions(np.array([VIDEO] * 3), VIDEO, [(1, 4, 4)], [1.0], 2)
