"""What the demo's accuracy must reach: per question kind, the accuracy the packaged model reached at training
time (`training.json`), less a binomial margin that a correct run misses with probability under MISS_PROBABILITY.

A run below it means the chain from the file to the answer is broken (frames, order, colours, positions), not
bad luck; `batchjob demo` exits 1 then, so CI's run of the README's demo command fails. The margin shrinks as
questions grow: with the demo's 16 clips every kind's bar sits well above chance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MISS_PROBABILITY = 1e-4


def bar(recorded: float, n: int, miss: float = MISS_PROBABILITY) -> float:
    """The lowest accuracy over `n` questions that a model of accuracy `recorded` falls below with probability
    under `miss`: the largest k/n with P(X < k) < miss, X ~ Binomial(n, recorded)."""
    if not (0.0 <= recorded <= 1.0) or n < 1:
        raise ValueError(f"bar needs an accuracy in [0, 1] and n >= 1, got {recorded!r} over {n!r}")
    tail, k = 0.0, 0
    while k <= n:
        p_k = math.comb(n, k) * recorded**k * (1 - recorded) ** (n - k)
        if tail + p_k >= miss:
            break
        tail += p_k
        k += 1
    return k / n


@dataclass(frozen=True)
class KindCheck:
    kind: str
    n: int                  # questions of this kind in the run
    accuracy: float
    recorded: float         # at training time, on fresh clips of the training distribution
    chance: float           # the mean over the questions of 1 / their number of options
    bar: float

    @property
    def passed(self) -> bool:
        return self.accuracy >= self.bar

    def describe(self) -> str:
        verdict = ">=" if self.passed else "BELOW"
        return (f"{self.kind} {self.accuracy:.4f} over {self.n} {verdict} bar {self.bar:.4f} "
                f"(recorded {self.recorded:.4f}, chance {self.chance:.2f})")


def chance_per_kind(records: list[dict]) -> dict[str, float]:
    """Chance accuracy per question kind (`category`) of manifest records: the mean of 1 / options."""
    sums: dict[str, list[float]] = {}
    for r in records:
        sums.setdefault(r["category"], []).append(1.0 / len(r["options"]))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def check_kinds(per_category: dict[str, dict], recorded: dict[str, float],
                chance: dict[str, float]) -> list[KindCheck]:
    """Each kind of a run's summary (`batchjob.pipeline.report.summarize`'s `per_category`) against its bar. A
    kind the training record does not know is an error: the demo asks only what its model was trained on."""
    unknown = sorted(set(per_category) - set(recorded))
    if unknown:
        raise ValueError(f"question kinds {unknown} have no recorded accuracy (recorded: {sorted(recorded)})")
    checks = [KindCheck(kind, v["n"], v["accuracy"], recorded[kind], chance[kind], bar(recorded[kind], v["n"]))
              for kind, v in sorted(per_category.items())]
    # All kinds pooled, against the bar at their mean recorded accuracy (a sum of binomials varies less than one
    # binomial at the mean, so a correct run holds it too): one broken kind among right ones shows here sooner.
    n = sum(c.n for c in checks)
    if len(checks) > 1 and n:
        mean = lambda f: sum(f(c) * c.n for c in checks) / n  # noqa: E731
        recorded_all = mean(lambda c: c.recorded)
        checks.append(KindCheck("all", n, mean(lambda c: c.accuracy), recorded_all, mean(lambda c: c.chance),
                                bar(min(recorded_all, 1.0), n)))
    return checks
