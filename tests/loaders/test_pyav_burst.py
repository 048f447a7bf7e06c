"""pyav_burst: keyframes when they cover the request, else a few spread keyframes each with a short burst.

Frames are checked against an independent full decode (conftest.full_decode) at the indices the loader
reports, and against the frame counter drawn into each picture, on fresh random clips.
"""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.loaders import InvalidArgument, load_video
from batchjob.loaders.picks import burst_targets, decode_order_bursts
from batchjob.loaders.registry import option_problems
from batchjob.loaders.pyav_burst import PyAVBurstLoader
from batchjob.synthetic.clips import make_clip, read_counter


def reference_plan(keys: list[int], total: int, num_frames: int, step: int) -> list[int]:
    """The documented placement, spelled out from the docstring (not imported): keyframe picks, repeats
    replaced by the frames `step` apart after the keyframe, inside its GOP."""
    if num_frames >= total:
        return list(range(total))
    k = len(keys)
    if num_frames <= k:
        picks = [int(p) for p in np.round(np.linspace(0, k - 1, num_frames))]
    else:
        picks = [int(np.floor((i + 0.5) * k / num_frames)) for i in range(num_frames)]
    out = []
    for i, p in enumerate(picks):
        j = i - picks.index(p)                       # how many times this keyframe came before
        m = picks.count(p)
        room = (keys[p + 1] if p + 1 < k else total) - keys[p]
        s = step if m < 2 else min(step, max(1, (room - 1) // (m - 1)))
        out.append(keys[p] + min(j * s, room - 1))
    return out


def check_burst_plan(keys: list[int], total: int, num_frames: int, step: int, got: list[int]) -> None:
    assert got == reference_plan(keys, total, num_frames, step)
    assert len(got) == num_frames and got == sorted(got) and 0 <= got[0] and got[-1] < total
    if len(set(got)) < len(got):   # repeats only when some anchor's stretch is shorter than its burst
        assert num_frames > len(keys) and num_frames > 2


def test_burst_plan_on_random_keyframe_layouts(rng):
    for _ in range(400):
        total = rng.randint(1, 900)
        gaps = rng.choice([1, 2, 5, 12, 30, 120, 1000])
        keys = sorted({0} | {rng.randrange(total) for _ in range(max(0, total // gaps))})
        num_frames = rng.choice([1, 2, 3, 7, 8, 16, rng.randint(1, 40)])
        step = rng.randint(1, 12)
        got = burst_targets(keys, total, num_frames if num_frames <= total else total, step)
        check_burst_plan(keys, total, min(num_frames, total), step, got)


def test_burst_plan_examples():
    assert burst_targets([0, 240], 480, 8, 6) == [0, 6, 12, 18, 240, 246, 252, 258]
    assert burst_targets([0], 480, 8, 4) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert burst_targets([0, 160, 320], 480, 8, 2) == [0, 2, 4, 160, 162, 320, 322, 324]   # picks 0,0,0,1,1,2,2,2
    assert burst_targets([0, 80, 160, 240, 320, 400], 480, 8, 2) == [0, 80, 82, 160, 240, 320, 322, 400]
    assert burst_targets([0, 3], 10, 8, 6) == [0, 1, 2, 2, 3, 5, 7, 9]   # a GOP shorter than its share repeats
    assert burst_targets(list(range(0, 480, 12)), 480, 8, 6) == [0, 72, 132, 204, 264, 336, 396, 468]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "6"])
def test_bad_step_in_the_plan(bad):
    with pytest.raises(ValueError, match="step"):
        burst_targets([0], 100, 8, bad)


def random_clip(tmp_path, rng, i: int, **fixed):
    fps = rng.choice([10, 24, 30])
    seconds = rng.uniform(0.4, 5.0)
    spec = dict(seconds=seconds, fps=fps, width=rng.choice([64, 96, 128]), height=rng.choice([48, 64, 72]),
                bframes=rng.choice([0, 1, 2, 3]), seed=rng.randrange(1000))
    kind = rng.choice(["gop1", "short", "long", "single"])
    if kind == "gop1":
        spec["gop_seconds"] = 1 / fps
    elif kind == "single":
        spec["single_keyframe"] = True
    else:
        spec["gop_seconds"] = rng.uniform(0.2, 1.0) if kind == "short" else rng.uniform(1.5, 8.0)
    spec.update(fixed)
    return make_clip(tmp_path / f"clip{i}.mp4", **spec), spec


def test_frames_equal_a_full_decode_on_random_clips(tmp_path, rng, expect):
    """Varied GOPs (1 frame, short, long, one keyframe), B-frames or none, requests above and below the count."""
    kinds = set()
    for i in range(40):     # 10 clips, and more while none took bursts (about 1 draw of 10 clips in 10^4)
        if i >= 10 and "bursts" in kinds:
            break
        info, spec = random_clip(tmp_path, rng, i, **({"single_keyframe": True} if i == 0 else
                                                      {"gop_seconds": 1 / 10, "fps": 10} if i == 1 else {}))
        ref = expect.full_decode(info.path)
        total = len(ref.frames)
        num_frames = rng.choice([rng.randint(1, 16), 8, total + rng.randint(0, 5)])
        step = rng.randint(1, 10)
        for use_index in (True, False):
            frames, meta = load_video(info.path, backend="pyav_burst", num_frames=num_frames, burst_step=step,
                                      use_index=use_index)
            indices = meta["frames_indices"]
            assert len(frames) == len(indices) == min(num_frames, total), spec
            check_burst_plan(ref.keyframe_indices, total, min(num_frames, total), step, indices)
            np.testing.assert_array_equal(frames, ref.at(indices))
            assert [read_counter(f) for f in frames] == indices   # the drawn counter agrees, independently
            assert meta["total_num_frames"] == total
            tb = 1 / info.fps
            np.testing.assert_allclose(meta["frames_timestamps"], [t * tb for t in indices],
                                       atol=1e-6)
            kinds.add(meta["burst_mode"])
            if num_frames >= total:
                assert indices == list(range(total)) and meta["do_sample_frames"] is True
    assert "bursts" in kinds


# Open GOPs, B-frames, Matroska (sweep), VFR, rotation, long GOPs, one keyframe: the clips both burst rules meet
EVERY_CODEC = ["hevc_bframes_mp4", "h264_open_gop_mp4", "mpeg4_bframes_mp4", "h264_bframes_mkv", "vp9_webm", "h264_vfr",
               "h264_rot90", "h264_long_gop", "h264_single_keyframe"]


@pytest.mark.parametrize("name", EVERY_CODEC)
def test_bursts_are_pixel_exact_on_every_codec(clips, rng, name):
    """Open GOPs, B-frames, Matroska (sweep), VFR, rotation: burst frames equal a full decode."""
    path, ref = clips(name)
    num_frames = min(len(ref.frames) - 1, len(ref.keyframe_indices) + rng.randint(1, 8))
    frames, meta = load_video(path, backend="pyav_burst", num_frames=num_frames, burst_step=rng.randint(1, 5))
    assert meta["burst_mode"] == "bursts"
    assert any(i not in ref.keyframe_indices for i in meta["frames_indices"])
    np.testing.assert_array_equal(frames, ref.at(meta["frames_indices"]))


def test_enough_keyframes_is_exactly_pyav_keyframes(clips, rng):
    path, ref = clips("h264_dense")
    num_frames = rng.randint(1, len(ref.keyframe_indices))
    a, meta_a = load_video(path, backend="pyav_burst", num_frames=num_frames)
    b, meta_b = load_video(path, backend="pyav_keyframes", num_frames=num_frames)
    assert meta_a["burst_mode"] == "keyframes" and meta_a["frames_indices"] == meta_b["frames_indices"]
    np.testing.assert_array_equal(a, b)


def test_cost_is_bounded_by_the_bursts_not_the_gop(tmp_path):
    """A 20 s single-keyframe clip: the loader decodes about num_frames * step pictures, not 200."""
    info = make_clip(tmp_path / "long.mp4", seconds=20, fps=10, single_keyframe=True, bframes=2, width=64,
                     height=48)
    frames, meta = load_video(info.path, backend="pyav_burst", num_frames=8, burst_step=3)
    assert meta["frames_indices"] == [0, 3, 6, 9, 12, 15, 18, 21]
    assert meta["decoded_frames"] <= 22 + 8   # the run, plus what B-frame reordering holds back


@pytest.mark.parametrize("bad", [-1, -2, 2.5, True, "6"])
def test_bad_burst_step_is_refused_clearly(clips, bad):
    path, _ = clips("h264_single_keyframe")
    with pytest.raises(InvalidArgument, match="burst_step") as info:
        load_video(path, backend="pyav_burst", burst_step=bad)
    assert path in str(info.value)
    assert any(p.startswith("burst_step:") for p in option_problems(PyAVBurstLoader, {"burst_step": bad}))
    assert option_problems(PyAVBurstLoader, {"burst_step": 4, "use_index": False}) == []


# burst_step=0: the pictures decoded right after each keyframe (picks.decode_order_bursts)


def decode_order_of(path: str, keyframe_indices: list[int]) -> tuple[list[int], list[int]]:
    """Independently of the loader: every packet's presentation index in decode order, and where each keyframe
    sits in it, from a plain demux."""
    import av

    with av.open(path) as container:
        pts = [p.pts for p in container.demux(video=0) if p.size]
    rank = {p: i for i, p in enumerate(sorted(pts))}
    order = [rank[p] for p in pts]
    return order, [order.index(k) for k in keyframe_indices]


def reference_decode_plan(keys: list[int], positions: list[int], order: list[int], num_frames: int,
                          most: int | None = None) -> list[int]:
    """The documented placement, spelled out: per picked keyframe shown m times, among the pictures decoded
    after it and before the next keyframe that are shown inside its GOP, the m - 1 decoded first (at most
    `most` - 1); in presentation order, a short GOP (or a capped burst) repeating its last frame."""
    total = len(order)
    if num_frames >= total:
        return list(range(total))
    k = len(keys)
    picks = ([int(p) for p in np.round(np.linspace(0, k - 1, num_frames))] if num_frames <= k else
             [int(np.floor((i + 0.5) * k / num_frames)) for i in range(num_frames)])
    out = []
    for p in sorted(set(picks)):
        m = picks.count(p)
        end = keys[p + 1] if p + 1 < k else total
        stop = positions[p + 1] if p + 1 < k else total
        own = sorted((j, order[j]) for j in range(positions[p], stop) if keys[p] < order[j] < end)
        got = sorted([keys[p]] + [i for _, i in own[:min(m, most or m) - 1]])
        out += got + [got[-1]] * (m - len(got))
    return out


def test_decode_order_plan_on_random_layouts(rng):
    """Random decode orders with B-frame-like reordering: the plan is the reference's, sorted, and each
    keyframe's frames are a prefix of its GOP's decode order (the fewest pictures that reach them)."""
    for _ in range(300):
        total = rng.randint(2, 400)
        bframes = rng.choice([0, 1, 2, 3])
        gap = rng.choice([1, 3, 12, 50, 1000])
        keys = sorted({0} | {rng.randrange(total) for _ in range(total // gap)})
        order = []
        for a, b in zip(keys, keys[1:] + [total]):      # per GOP: I, then P before the B-frames it closes
            gop = list(range(a, b))
            order.append(gop[0])
            rest = gop[1:]
            while rest:
                run = rest[:bframes + 1]
                rest = rest[bframes + 1:]
                order += [run[-1]] + run[:-1]
        positions = [order.index(k) for k in keys]
        num_frames = rng.randint(1, min(total, 40))
        most = rng.choice([None, 1, 2, 3, rng.randint(1, 10)])
        got = decode_order_bursts(keys, positions, order, num_frames, most)
        assert got == reference_decode_plan(keys, positions, order, num_frames, most)
        if most is not None and num_frames < total:    # a clip returned whole is every frame, capped or not
            assert len(set(got)) <= most * len(keys)
        assert len(got) == num_frames and got == sorted(got)
        for p, key in enumerate(keys):
            mine = {i for i in got if key <= i < (keys[p + 1] if p + 1 < len(keys) else total)}
            if mine:
                reach = max(order.index(i) for i in mine) - positions[p] + 1
                assert reach == len(mine)


def test_decode_order_plan_examples():
    # I0 P3 B1 B2 P6 B4 B5 P9 B7 B8: two B-frames; keyframes 0 and 10 of a 20-frame clip
    order = [0, 3, 1, 2, 6, 4, 5, 9, 7, 8, 10, 13, 11, 12, 16, 14, 15, 19, 17, 18]
    assert decode_order_bursts([0, 10], [0, 10], order, 4) == [0, 3, 10, 13]
    assert decode_order_bursts([0, 10], [0, 10], order, 6) == [0, 1, 3, 10, 11, 13]
    assert decode_order_bursts([0, 10], [0, 10], order, 8) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert decode_order_bursts([0], [0], [0, 2, 1], 2) == [0, 2]   # a 3-frame clip decoded I0 P2 B1
    assert decode_order_bursts([0, 2], [0, 2], [0, 1, 2, 3], 4) == [0, 1, 2, 3]
    assert decode_order_bursts([0, 2], [0, 2], [0, 1, 2, 3, 4], 4) == [0, 1, 2, 3]
    assert decode_order_bursts([0, 1], [0, 1], [0, 1, 2], 2) == [0, 1]       # enough keyframes: one each
    assert decode_order_bursts([0, 1], [0, 1], [0, 1, 2, 3, 4], 4) == [0, 0, 1, 2]   # a 1-frame GOP repeats
    assert decode_order_bursts([0, 10], [0, 10], order, 8, most=2) == [0, 3, 3, 3, 10, 13, 13, 13]
    assert decode_order_bursts([0, 10], [0, 10], order, 8, most=3) == [0, 1, 3, 3, 10, 11, 13, 13]
    assert decode_order_bursts([0, 10], [0, 10], order, 4, most=1) == [0, 0, 10, 10]


@pytest.mark.parametrize("most", [0, -1, 1.5, True])
def test_bad_burst_cap(most):
    with pytest.raises(ValueError, match="most must be a positive integer"):
        decode_order_bursts([0], [0], [0, 1, 2], 2, most)


@pytest.mark.parametrize("bad", [([], [], [0, 1], 1), ([0], [0, 1], [0, 1], 1), ([0], [0], [], 1), ([0], [0], [0], 0)])
def test_bad_decode_order_plan(bad):
    with pytest.raises(ValueError, match="need keyframes"):
        decode_order_bursts(*bad)


def test_decode_order_frames_equal_a_full_decode_on_random_clips(tmp_path, rng, expect):
    """Seeded random clips (B-frames or none, short and long GOPs, one keyframe, GOP longer than the clip, very
    short clips): the frames are a full decode's at the plan an independent demux gives."""
    kinds = set()
    for i in range(10):
        fixed = ({"single_keyframe": True} if i == 0 else
                 {"gop_seconds": 30.0} if i == 1 else                      # a GOP longer than the clip
                 {"seconds": rng.uniform(0.1, 0.4), "fps": 10} if i == 2 else {})   # 1-4 frames
        info, spec = random_clip(tmp_path, rng, i, **fixed)
        ref = expect.full_decode(info.path)
        total = len(ref.frames)
        order, positions = decode_order_of(info.path, ref.keyframe_indices)
        num_frames = rng.choice([rng.randint(1, 16), 8, total + rng.randint(0, 3)])
        want = min(num_frames, total)
        for use_index in (True, False):
            frames, meta = load_video(info.path, backend="pyav_burst", num_frames=num_frames, burst_step=0,
                                      use_index=use_index)
            indices = meta["frames_indices"]
            if want > len(ref.keyframe_indices):
                assert indices == reference_decode_plan(ref.keyframe_indices, positions, order, want), spec
                assert meta["burst_mode"] == "bursts" and meta["burst_step"] == 0
            else:
                assert meta["burst_mode"] == "keyframes"
            np.testing.assert_array_equal(frames, ref.at(indices))
            assert [read_counter(f) for f in frames] == indices
            kinds.add(meta["burst_mode"])
    assert "bursts" in kinds


@pytest.mark.parametrize("name", EVERY_CODEC)
def test_decode_order_bursts_are_pixel_exact_on_every_codec(clips, rng, name):
    path, ref = clips(name)
    num_frames = min(len(ref.frames) - 1, len(ref.keyframe_indices) + rng.randint(1, 8))
    frames, meta = load_video(path, backend="pyav_burst", num_frames=num_frames, burst_step=0)
    order, positions = decode_order_of(path, ref.keyframe_indices)
    assert meta["frames_indices"] == reference_decode_plan(ref.keyframe_indices, positions, order, num_frames)
    np.testing.assert_array_equal(frames, ref.at(meta["frames_indices"]))


def test_burst_pictures_caps_the_pictures_decoded(tmp_path, rng, expect):
    """burst_pictures=N: at most N pictures per keyframe, the frames a full decode's at the capped plan."""
    info = make_clip(tmp_path / "c.mp4", seconds=rng.uniform(4, 8), fps=10, gop_seconds=rng.uniform(2.5, 4),
                     bframes=2, width=64, height=48, seed=rng.randrange(1000))
    ref = expect.full_decode(info.path)
    order, positions = decode_order_of(info.path, ref.keyframe_indices)
    most = rng.randint(1, 3)
    frames, meta = load_video(info.path, backend="pyav_burst", num_frames=8, burst_pictures=most)
    assert meta["burst_mode"] == "bursts" and meta["burst_pictures"] == most
    assert meta["frames_indices"] == reference_decode_plan(ref.keyframe_indices, positions, order, 8, most)
    assert meta["decoded_frames"] <= most * len(ref.keyframe_indices)
    np.testing.assert_array_equal(frames, ref.at(meta["frames_indices"]))


@pytest.mark.parametrize("kwargs,match", [({"burst_pictures": -1}, "burst_pictures must be"),
                                          ({"burst_pictures": 2, "burst_step": 3}, "drop one of")])
def test_bad_burst_pictures_is_refused_clearly(clips, kwargs, match):
    path, _ = clips("h264_long_gop")
    with pytest.raises(InvalidArgument, match=match) as info:
        load_video(path, backend="pyav_burst", **kwargs)
    assert path in str(info.value)


def test_decode_order_reaches_further_for_less(tmp_path):
    """B-frames, one keyframe: the 8 frames by decode order need the first 8 packets; the frames 1 apart need
    at least as many and end no later."""
    info = make_clip(tmp_path / "long.mp4", seconds=20, fps=10, single_keyframe=True, bframes=2, width=64,
                     height=48)
    order, _ = decode_order_of(info.path, [0])
    _, by_decode = load_video(info.path, backend="pyav_burst", num_frames=8, burst_step=0)
    _, by_step = load_video(info.path, backend="pyav_burst", num_frames=8, burst_step=1)
    assert by_decode["frames_indices"] == sorted(order[:8]) and by_step["frames_indices"] == list(range(8))
    reach = [max(order.index(i) for i in m["frames_indices"]) + 1 for m in (by_decode, by_step)]
    assert reach[0] == 8 <= reach[1] and by_decode["frames_indices"][-1] >= 7
    assert order[:8] != list(range(8))   # the encoder did reorder, or this test shows nothing


def test_the_default_is_decode_order(tmp_path, rng, expect):
    info = make_clip(tmp_path / "d.mp4", seconds=rng.uniform(3, 6), fps=10, gop_seconds=rng.uniform(1.5, 2.5),
                     bframes=2, width=64, height=48, seed=rng.randrange(1000))
    ref = expect.full_decode(info.path)
    order, positions = decode_order_of(info.path, ref.keyframe_indices)
    frames, meta = load_video(info.path, backend="pyav_burst", num_frames=8)
    assert meta["burst_mode"] == "bursts" and meta["burst_step"] == 0
    assert meta["frames_indices"] == reference_decode_plan(ref.keyframe_indices, positions, order, 8)
    np.testing.assert_array_equal(frames, ref.at(meta["frames_indices"]))
