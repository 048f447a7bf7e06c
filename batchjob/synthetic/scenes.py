"""Scenes of moving shapes with questions whose answers are known: what the demo model learns and is tested on.

A scene is 1-3 shapes (square or disc, distinct colours) on a textured, noisy background. The biggest shape
always moves; with two or more shapes, others may move too, one after another (never at the same time), so
"which moved first" has one answer. Each mover travels in a straight line (left or right) during its own
window of the clip and stands still before and after it. Positions are a pure function of the clip's time,
so a scene renders at any frame rate, size or sampling, and a clip encoded from it has the same answers.

How movers move (`MOTIONS`):
- "wrap" (the default): the frame is a horizontal loop. A mover leaves at one edge and comes back in at the
  other; its start is uniform over the loop (`Shape.lap`: the width plus its own, so it is never cut in two)
  and it has a lane of its own (no other shape in its rows), so where it stands in any one frame is uniform
  whatever its direction: only two frames in order tell the direction. It covers SPEED widths per clip, 0.11
  to 0.21 of the width between two of eight uniformly sampled frames: seen in one pair of frames, far under
  half the loop, so the shorter way round is the way it went.
- "span" (the earlier scenes): a mover stays inside the frame and travels at least half the free width, so it
  starts on the side opposite to where it goes, and one frame gives its direction away.

Question kinds need different things from the video:
- colour, count: one frame is enough;
- direction, order: at least two frames, in the right order and at the right times.

Options come in a fixed order per kind (colours always red, green, blue, yellow): the tiny demo model learns
to see, not to match option text, and a wrong answer is a wrong look at the video.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (225, 40, 40), "green": (40, 195, 60), "blue": (45, 95, 240), "yellow": (240, 210, 40)}
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0)}
COUNT_WORDS = ("one", "two", "three")
KINDS = ("colour", "count", "direction", "order")
SHAPES = ("square", "disc")

# Fixed wording and options per kind; `question_for` fills in the answer.
QUESTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "colour": ("What colour is the biggest shape?", tuple(PALETTE)),
    "count": ("How many shapes are there?", COUNT_WORDS),
    "direction": ("Which way does the biggest shape move?", tuple(DIRECTIONS)),
    "order": ("Which shape moves first?", tuple(PALETTE)),
}
# Words the demo tokenizer learns as whole tokens (prompts stay short, as with a real tokenizer).
VOCABULARY = tuple(q for q, _ in QUESTIONS.values()) + tuple(
    " ".join(opts) for _, opts in QUESTIONS.values()) + ("seconds shape shapes colour biggest moves first",)

MOTIONS = ("wrap", "span")
MOTION = "wrap"
MIN_TRAVEL = 0.5     # "span": of the free range along the axis: visible after any resize to a few dozen pixels
MIN_WINDOW = 0.25    # of the clip: a mover spans at least two of eight uniformly sampled frames
SINGLE_WINDOW = (0.25, 0.5)  # "span": a lone mover moves fast: its motion shows inside one pair of sampled frames
WRAP_SINGLE_WINDOW = (0.5, 1.0)  # "wrap": a lone mover moves for half the clip or more (more pairs show it)
SPEED = (0.8, 1.5)   # "wrap": widths per clip, so 0.11-0.21 of the width between adjacent of 8 uniform frames


@dataclass(frozen=True)
class Shape:
    colour: str
    form: str                      # "square" or "disc"
    size: float                    # side or diameter, as a fraction of the frame height
    start: tuple[float, float]     # centre at the clip's start, as fractions of (width, height)
    direction: str | None          # None: stands still
    travel: float                  # distance covered, as a fraction of the frame's width (x) or height (y)
    window: tuple[float, float]    # the part of the clip (fractions of its duration) during which it moves
    # "wrap": length of the horizontal loop its centre runs on (width fractions): 1 + size / the scene's aspect,
    # so left out of the repr (clip digests of "span" scenes stay what they were)
    lap: float | None = field(default=None, repr=False)

    def centre(self, u: float) -> tuple[float, float]:
        """Centre at clip fraction `u` (0 = first frame, 1 = the end)."""
        if self.direction is None:
            return self.start
        w0, w1 = self.window
        progress = min(1.0, max(0.0, (u - w0) / (w1 - w0)))
        dx, dy = DIRECTIONS[self.direction]
        x, y = self.start[0] + dx * self.travel * progress, self.start[1] + dy * self.travel * progress
        if self.lap:      # the loop runs from half a shape left of the frame to half a shape right of it
            edge = (self.lap - 1) / 2
            x = (x + edge) % self.lap - edge
        return x, y


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]      # shapes[0] is the biggest and always moves
    background: tuple[int, int, int]
    texture: int                   # seed of the background's fixed texture
    noise: float                   # per-frame pixel noise (standard deviation, 0-255 scale)
    aspect: float = 16 / 9         # width / height the positions were planned for

    @property
    def movers(self) -> list[Shape]:
        """Moving shapes in the order they start moving."""
        return sorted((s for s in self.shapes if s.direction), key=lambda s: s.window[0])

    def answers(self) -> dict[str, str]:
        """The answer of every kind this scene can be asked about (order needs two movers)."""
        out = {"colour": self.shapes[0].colour, "count": COUNT_WORDS[len(self.shapes) - 1],
               "direction": str(self.shapes[0].direction)}
        if len(self.movers) >= 2:
            out["order"] = self.movers[0].colour
        return out


def clip_digest(scene: Scene, *encoding) -> str:
    """A short name for what a cached clip shows: the scene and how it was encoded (length, size, GOP, noise
    seed...). Caches named by a seed alone pair old videos with new answers once a change to how scenes are
    drawn makes the same seed draw other scenes."""
    return hashlib.sha256(repr((scene, encoding)).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    options: tuple[str, ...]
    answer: int                    # index into options


def questions_for(scene: Scene) -> list[Question]:
    """One question per kind the scene supports, in KINDS order."""
    out = []
    for kind, answer in scene.answers().items():
        text, options = QUESTIONS[kind]
        out.append(Question(kind, text, options, options.index(answer)))
    return out


def _boxes(shape: Shape, aspect: float, steps: np.ndarray) -> np.ndarray:
    """[len(steps), 4] bounding boxes (x0, y0, x1, y1) in height units over the clip."""
    centres = np.array([shape.centre(float(u)) for u in steps])
    cx, cy = centres[:, 0] * aspect, centres[:, 1]
    half = shape.size / 2
    return np.stack([cx - half, cy - half, cx + half, cy + half], axis=1)


def _apart(a: Shape, b: Shape, aspect: float, margin: float = 0.04) -> bool:
    """True when the two shapes never touch (checked at 33 instants over the clip). A shape on a loop has a lane
    of its own: no other shape in its rows, so no placement is refused for where along the loop it is (a refusal
    that depended on it would tell the direction from one frame)."""
    if a.lap or b.lap:
        (ya, ha), (yb, hb) = (a.start[1], a.size / 2), (b.start[1], b.size / 2)
        return abs(ya - yb) >= ha + hb + margin
    steps = np.linspace(0, 1, 33)
    ba, bb = _boxes(a, aspect, steps), _boxes(b, aspect, steps)
    overlap_x = (ba[:, 0] < bb[:, 2] + margin) & (bb[:, 0] < ba[:, 2] + margin)
    overlap_y = (ba[:, 1] < bb[:, 3] + margin) & (bb[:, 1] < ba[:, 3] + margin)
    return not np.any(overlap_x & overlap_y)


def _windows(rng: np.random.Generator, movers: int, motion: str) -> list[tuple[float, float]]:
    """Consecutive, non-overlapping motion windows inside the clip, each at least MIN_WINDOW long."""
    if movers == 1:
        length = rng.uniform(*(WRAP_SINGLE_WINDOW if motion == "wrap" else SINGLE_WINDOW))
        start = rng.uniform(0.0, 1.0 - length)
        return [(start, start + length)]
    lo, hi = 0.03, 0.97
    # the slack beyond the minimum lengths is shared by the windows and the gaps before, between and after them
    share = rng.dirichlet(np.ones(2 * movers + 1)) * ((hi - lo) - movers * MIN_WINDOW)
    windows, cursor = [], lo + share[0]
    for i in range(movers):
        end = cursor + MIN_WINDOW + share[2 * i + 1]
        windows.append((float(cursor), float(end)))
        cursor = end + share[2 * i + 2]
    return windows


def _shape(rng: np.random.Generator, colour: str, size: float, window: tuple[float, float] | None,
           aspect: float, motion: str) -> Shape:
    half_w, half_h = size / 2 / aspect, size / 2        # half size in width / height fractions
    direction = None if window is None else str(rng.choice(list(DIRECTIONS)))
    travel = 0.0
    x = rng.uniform(half_w, 1 - half_w)
    y = rng.uniform(half_h, 1 - half_h)
    if direction is not None and motion == "wrap":      # start anywhere on the loop, whatever the direction
        lap = 1 + 2 * half_w
        travel = rng.uniform(*SPEED) * (window[1] - window[0])
        return Shape(colour, str(rng.choice(SHAPES)), size, (float(rng.uniform(-half_w, 1 + half_w)), float(y)),
                     direction, float(travel), window, float(lap))
    if direction is not None:
        dx, dy = DIRECTIONS[direction]
        lo, hi = (half_w, 1 - half_w) if dx else (half_h, 1 - half_h)
        free = hi - lo
        travel = rng.uniform(MIN_TRAVEL, 1.0) * free
        start = rng.uniform(lo, hi - travel)
        start = start if (dx or dy) > 0 else start + travel   # moving left/up starts at the far side
        x, y = (start, y) if dx else (x, start)
    return Shape(colour, str(rng.choice(SHAPES)), size, (float(x), float(y)), direction, float(travel),
                 window or (0.0, 1.0))


def random_scene(rng: np.random.Generator, aspect: float = 16 / 9, *, order: bool | None = None,
                 motion: str | None = None) -> Scene:
    """A scene drawn from the training distribution (see the module docstring); `order=True` draws one with
    two or more movers (an order question exists), `False` one with a single mover, None either; `motion` is
    one of MOTIONS (default MOTION)."""
    motion = motion or MOTION
    if motion not in MOTIONS:
        raise ValueError(f"unknown motion {motion!r}: use one of {', '.join(MOTIONS)}")
    for _ in range(1000):
        n = int(rng.integers(2, 4) if order else rng.integers(1, 4))
        colours = [str(c) for c in rng.permutation(list(PALETTE))[:n]]
        # the biggest is clearly the biggest: 1.4x to 2.5x the others
        big = rng.uniform(0.3, 0.42)
        sizes = [big] + [big / rng.uniform(1.4, 2.0) for _ in range(n - 1)]
        moves = [True] + [bool(rng.random() < 0.5) for _ in range(n - 1)]
        if order:
            moves[int(rng.integers(1, n))] = True
        elif order is False:
            moves = [True] + [False] * (n - 1)
        starts = [int(i) for i in rng.permutation([i for i, m in enumerate(moves) if m])]  # who moves when
        windows = dict(zip(starts, _windows(rng, len(starts), motion)))
        shapes = [_shape(rng, colours[i], sizes[i], windows.get(i), aspect, motion) for i in range(n)]
        if all(_apart(a, b, aspect) for i, a in enumerate(shapes) for b in shapes[i + 1:]):
            tint = rng.integers(-12, 13, size=3)
            base = int(rng.integers(25, 110))
            background = tuple(int(np.clip(base + t, 0, 255)) for t in tint)
            return Scene(tuple(shapes), background, int(rng.integers(2**31)), float(rng.uniform(0, 4)), aspect)
    raise RuntimeError("could not place non-overlapping shapes in 1000 tries")


def background(scene: Scene, width: int, height: int) -> np.ndarray:
    """The scene's fixed background, float32 [H, W, 3]: a base colour plus a smooth low-contrast texture
    (backgrounds are not flat in real video). Render many frames of one scene from one background."""
    rng = np.random.default_rng(scene.texture)
    coarse = rng.normal(0, 8, size=(4, 7)).astype(np.float32)
    ys = np.linspace(0, coarse.shape[0] - 1, height, dtype=np.float32)
    xs = np.linspace(0, coarse.shape[1] - 1, width, dtype=np.float32)
    rows = np.stack([np.interp(ys, np.arange(coarse.shape[0]), coarse[:, j]) for j in range(coarse.shape[1])], 1)
    smooth = np.stack([np.interp(xs, np.arange(coarse.shape[1]), r) for r in rows])
    return (np.asarray(scene.background, np.float32) + smooth[..., None]).astype(np.float32)


def render(scene: Scene, u: float, width: int, height: int, noise_seed: int | None = None,
           base: np.ndarray | None = None) -> np.ndarray:
    """The frame at clip fraction `u` as uint8 RGB [height, width, 3]; `base` is `background(scene, ...)`."""
    img = (background(scene, width, height) if base is None else base).copy()
    for shape in reversed(scene.shapes):          # the biggest drawn last: on top if anything ever touched
        cx, cy = shape.centre(u)
        px, py, r = cx * width, cy * height, shape.size * height / 2
        x0, x1 = max(0, int(px - r) - 1), min(width, int(px + r) + 2)
        y0, y1 = max(0, int(py - r) - 1), min(height, int(py + r) + 2)
        if x0 >= x1 or y0 >= y1:
            continue
        xx = np.arange(x0, x1, dtype=np.float32)[None, :] + 0.5 - px
        yy = np.arange(y0, y1, dtype=np.float32)[:, None] + 0.5 - py
        if shape.form == "square":
            mask = (np.abs(xx) <= r) & (np.abs(yy) <= r)
        else:
            mask = xx * xx + yy * yy <= r * r
        img[y0:y1, x0:x1][mask] = PALETTE[shape.colour]
    if scene.noise > 0:
        rng = np.random.default_rng(noise_seed)
        img += rng.standard_normal(size=img.shape, dtype=np.float32) * np.float32(scene.noise)
    return np.clip(img + 0.5, 0, 255).astype(np.uint8)
