"""Engine batch forming (pure): packing width, and isolation of a clip that makes the engine fail."""
from __future__ import annotations

import random
from collections import deque

from batchjob.contract import ClipJob
from batchjob.pipeline.work import ClipWork, take_batch


def _clips(rng: random.Random, n: int, solo_share: float = 0.0) -> list[tuple[ClipWork, int]]:
    return [(ClipWork(ClipJob(f"v{i}.mp4", f"m{i}", ()), rows=[], solo=rng.random() < solo_share), i)
            for i in range(n)]


def test_batches_are_front_prefixes_and_solo_clips_go_alone(rng):
    for _ in range(200):
        items = _clips(rng, rng.randint(1, 12), solo_share=rng.random())
        width = rng.randint(1, 5)
        queue = deque(items)
        taken = []
        while queue:
            batch = take_batch(queue, width)
            assert 1 <= len(batch) <= width
            assert len(batch) == 1 or not any(c.solo for c, _ in batch)
            taken += batch
        assert taken == items   # order kept, nothing lost or repeated


def test_a_clip_that_always_fails_is_isolated_and_the_rest_answered(rng):
    """The driver's retry rule: a failed multi-clip batch goes back marked solo; a failed single is an error."""
    for _ in range(50):
        items = _clips(rng, rng.randint(2, 12))
        bad = set(rng.sample(range(len(items)), rng.randint(1, len(items) - 1)))
        width = rng.randint(2, 5)
        queue, answered, errors = deque(items), set(), set()
        for _step in range(10 * len(items)):
            if not queue:
                break
            batch = take_batch(queue, width)
            if any(i in bad for _, i in batch):
                if len(batch) > 1:
                    for item in reversed(batch):
                        item[0].solo = True
                        queue.appendleft(item)
                else:
                    errors.add(batch[0][1])
            else:
                answered |= {i for _, i in batch}
        assert not queue, "the retry loop did not terminate"
        assert errors == bad and answered == set(range(len(items))) - bad
