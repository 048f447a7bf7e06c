"""Demo scenes encoded at several GOP lengths, for the sampler curve (scripts/sampler_curve.py).

Each scene is rendered once per frame and fed to one encoder per GOP length, so every GOP variant of a scene
holds the same pictures and only the keyframe spacing differs. Sensor noise is fresh in every frame (rolled
copies of a few noise fields: cheaper than drawing 2.7 M normals a frame, and no encoder can predict it), so
predicted pictures cost what they cost in camera footage (NOISE, CRF below). Files are cached by name (the name
carries every setting they depend on) and written under a temporary name first, so an interrupted run never
leaves a torn one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

SINGLE = 0.0   # GOP length meaning "one keyframe for the whole clip"
# Sensor noise (standard deviation, 0-255) and x264 quality: together they give these 720p scenes a camera's
# bitrate (3-5 Mbit/s) and keyframes about six times the size of the pictures between them. Less noise or a
# higher CRF and x264 codes the noise away, predicted pictures become nearly free to decode, and the curve
# would flatter every loader that decodes forward.
NOISE, CRF = 3.5, 19


def gop_label(gop_seconds: float) -> str:
    return "1key" if gop_seconds <= 0 else f"{gop_seconds:g}s"


@dataclass(frozen=True)
class ScenePlan:
    width: int
    height: int
    seconds: float
    fps: int
    gops: tuple[float, ...]
    seed: int

    def name(self, index: int, gop: float, scene) -> str:
        """The cached file's name: the plan, and a digest of the scene itself, so a change to how scenes are
        drawn (the same seed giving other scenes) encodes new files instead of pairing old videos with new
        answers."""
        from batchjob.synthetic.scenes import clip_digest

        digest = clip_digest(scene)       # the plan's own values are in the name already
        return (f"scene-{self.width}x{self.height}-{self.seconds:g}s-{self.fps}fps-n{NOISE:g}-crf{CRF}-seed{self.seed}-"
                f"{index:03d}-{digest}-gop{gop_label(gop)}.mp4")


def _open_encoder(path: Path, plan: ScenePlan, gop_seconds: float, frames: int):
    import av

    gop = frames + 1 if gop_seconds <= 0 else max(1, int(round(gop_seconds * plan.fps)))
    out = av.open(str(path), "w", format="mp4")
    stream = out.add_stream("libx264", rate=Fraction(plan.fps))
    stream.width, stream.height, stream.pix_fmt = plan.width, plan.height, "yuv420p"
    stream.codec_context.gop_size = gop
    stream.codec_context.max_b_frames = 2
    stream.options = {"preset": "veryfast", "crf": str(CRF),
                      "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=2:log-level=error"}
    return out, stream


def encode_scene(folder: Path, plan: ScenePlan, index: int, scene) -> None:
    """Every GOP variant of one scene (skipped when all exist)."""
    import av

    from batchjob.synthetic.scenes import background, render

    paths = [folder / plan.name(index, g, scene) for g in plan.gops]
    if all(p.exists() for p in paths):
        return
    frames = int(round(plan.seconds * plan.fps))
    quiet = dataclasses.replace(scene, noise=0.0)
    base = background(scene, plan.width, plan.height)
    rng = np.random.default_rng([plan.seed, index])
    fields = [np.rint(rng.normal(0, NOISE, size=plan.height * plan.width * 3)).astype(np.int16)
              for _ in range(4)]
    tmps = [p.with_name("." + p.name) for p in paths]
    encoders = [_open_encoder(t, plan, g, frames) for t, g in zip(tmps, plan.gops)]
    try:
        for i in range(frames):
            img = render(quiet, i / frames, plan.width, plan.height, None, base)
            noise = np.roll(fields[i % len(fields)], int(rng.integers(fields[0].size)))
            img = np.clip(img.astype(np.int16) + noise.reshape(img.shape), 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format="yuv420p")
            frame.pts = i
            for out, stream in encoders:
                out.mux(stream.encode(frame))
        for out, stream in encoders:
            out.mux(stream.encode(None))
    finally:
        for out, _ in encoders:
            out.close()
    for tmp, path in zip(tmps, paths):
        tmp.rename(path)


def _encode_one(job) -> None:
    encode_scene(*job)


def build_scene_set(folder: Path, plan: ScenePlan, count: int, workers: int = 1,
                    motion: str | None = None) -> list[dict]:
    """Encode (or reuse) `count` scenes at every GOP length of `plan`; one record per question and GOP variant:
    `video` (file name), `gop` (label), `scene`, `id`, `question`, `options`, `answer`, `category`.
    Every other scene has two or more movers (an order question), as in the demo set; `motion` is how movers
    move (`scenes.MOTIONS`: as the model answering was trained)."""
    from batchjob.synthetic.scenes import questions_for, random_scene

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(plan.seed)
    scenes = [random_scene(rng, plan.width / plan.height, order=bool(i % 2), motion=motion) for i in range(count)]
    jobs = [(folder, plan, i, scene) for i, scene in enumerate(scenes)
            if not all((folder / plan.name(i, g, scene)).exists() for g in plan.gops)]
    if workers > 1 and len(jobs) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            pool.map(_encode_one, jobs, chunksize=1)
    else:
        for job in jobs:
            _encode_one(job)
    records = []
    for i, scene in enumerate(scenes):
        for gop in plan.gops:
            for q in questions_for(scene):
                records.append({"id": f"{i:03d}-{gop_label(gop)}-{q.kind}", "video": plan.name(i, gop, scene),
                                "gop": gop_label(gop), "scene": i, "question": q.text, "options": list(q.options),
                                "answer": q.answer, "category": q.kind})
    return records
