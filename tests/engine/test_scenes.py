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
