"""The synthetic scenes the demo model learns from: what `random_scene` promises about its movers holds on
every draw, including draws that had to retry a placement."""
from __future__ import annotations

import numpy as np
import pytest

from batchjob.synthetic.scenes import questions_for, random_scene


@pytest.mark.parametrize("order", [True, False, None])
def test_random_scene_keeps_its_order_promise(order):
    """`order=True`: two or more movers (an order question); `False`: one mover; None: either. Many draws retry
    a placement (shapes overlapping), so a retry must keep the caller's request."""
    rng = np.random.default_rng(int.from_bytes(np.random.bytes(4), "little"))
    movers, shapes = [], []
    for _ in range(300):
        scene = random_scene(rng, order=order)
        movers.append(len(scene.movers))
        shapes.append(len(scene.shapes))
        assert scene.shapes[0].direction is not None
        assert ("order" in {q.kind for q in questions_for(scene)}) == (len(scene.movers) >= 2)
    movers = np.array(movers)
    if order is True:
        assert movers.min() >= 2
    elif order is False:
        assert movers.max() == 1 and max(shapes) == 3      # lone movers among still shapes, up to three
    else:
        assert movers.min() == 1 and movers.max() >= 2


def test_a_cached_clips_name_changes_with_what_it_shows(tmp_path):
    """Cached demo and benchmark clips are named by `clip_digest`: the same scene and encoding give the same name
    (the cache is reused), another scene or encoding another name (an old video is never paired with new answers,
    as a seed-only name did once the scenes' drawing changed)."""
    import dataclasses

    from batchjob.demo import build_scene_clips
    from batchjob.synthetic.scenes import clip_digest

    seed = int.from_bytes(np.random.bytes(4), "little")
    a, b = (random_scene(np.random.default_rng(seed)) for _ in range(2))
    assert a == b and clip_digest(a, 2.0, 10) == clip_digest(b, 2.0, 10)
    moved = dataclasses.replace(a, shapes=(dataclasses.replace(a.shapes[0], travel=a.shapes[0].travel * 0.9),
                                           *a.shapes[1:]))
    assert len({clip_digest(a, 2.0, 10), clip_digest(moved, 2.0, 10), clip_digest(a, 2.1, 10),
                clip_digest(a, 2.0, 12)}) == 4
    first = build_scene_clips(tmp_path, 2, seed=seed % 1000)
    files = sorted(p.name for p in tmp_path.glob("*.mp4"))
    assert sorted({r["video"] for r in first}) == files and len(files) == 2
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.mp4")}
    assert build_scene_clips(tmp_path, 2, seed=seed % 1000) == first
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.mp4")} == written    # reused, not re-encoded
