"""One `classify` call's intake: its prompts built and its clips' towers started a step ahead of the device.

Why: done in step order, a call's host work (rendering and tokenizing prompts, building the towers' graphs,
scheduling) runs while the device has nothing queued: every prompt before the first step, each step's towers after
the step before it has returned. Nothing a step needs from the host depends on the answers of the step before (a
prefill's token counts are known up front), so the host can do it earlier:
- before the first step, only the towers that step encodes are started and only the prompts it takes are built;
- while a step's pass runs, the host's waits between its layers (`runner.forward`'s `on_wait`) do the next step's
  towers and the prompts for the step after, a piece at a time (`StepAhead`); what is left is done once the whole
  pass is queued (`on_queued`). Towers queued mid-pass run between the pass's layers: the same device work, with no
  gap left for the host's.

Features are then held for at most one step ahead, and the clip that step's end cuts
(`classifier.plan_engine_memory` counts them). The guess of what the next step reaches counts video tokens only,
so it never falls short of the step; a clip it missed all the same is encoded by the step that needs it. The prompts
built ahead are counted by an estimate of their new tokens (a cached prefix is known only once blocks are allocated);
a step that takes every one of them with budget left builds more as it is scheduled (`refill`), so each step takes
what it would with every prompt built up front.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from typing import Sequence as Seq

from .scheduler import ScheduledSlice, Scheduler, Sequence
from .types import ClassifyRequest, ClassifyResult

if TYPE_CHECKING:
    from .classifier import Classifier
    from .preprocess import VideoPlan


@dataclass(frozen=True)
class KeyGroup:
    """The requests (indices in admission order) that share one media key: one clip's, or one request's when
    prefix sharing is off."""

    key: str
    indices: tuple[int, ...]


def key_groups(keys: Seq[str], order: Seq[int]) -> list[KeyGroup]:
    """Runs of equal keys along `order` (`keys[i]`: request i's media key), in order."""
    groups: list[tuple[str, list[int]]] = []
    for i in order:
        if groups and groups[-1][0] == keys[i]:
            groups[-1][1].append(i)
        else:
            groups.append((keys[i], [i]))
    return [KeyGroup(key, tuple(indices)) for key, indices in groups]


# Prompts are built until those waiting hold this many steps' tokens: a step's scheduler must find a full step's worth
# it may take, and the count is an estimate (followers still waiting for their leader's prefix are passed over).
ADMIT_STEPS = 2


def new_tokens(seq: Sequence, follows: bool) -> int:
    """The tokens a waiting sequence will compute, as far as is known before its blocks are allocated: a follower
    (its clip's leader admitted before it) computes what follows the shared video; a leader, its whole prompt
    (less, if the clip's prefix is cached from an earlier call)."""
    if follows and seq.share_prefix:
        return seq.num_tokens - seq.video_span[1]
    return seq.remaining


@dataclass
class CallIntake:
    """The call's requests, admitted into `scheduler` a step ahead; `results` holds the requests that failed their
    preparation, `pending` the admitted requests per media key still in flight."""

    clf: Classifier
    requests: Seq[ClassifyRequest]
    call_id: int
    scheduler: Scheduler
    groups: list[KeyGroup]
    results: list[ClassifyResult | None]
    pending: dict[str, int] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)   # towers started ahead, this call
    closed: set[str] = field(default_factory=set)    # keys whose requests all finished or all failed
    next_tower: int = 0     # groups before it have their towers started, held, or need none
    next_prepare: int = 0   # groups before it are admitted (or failed)

    @classmethod
    def open(cls, clf: Classifier, requests: Seq[ClassifyRequest], order: Seq[int], call_id: int,
             scheduler: Scheduler) -> CallIntake:
        keys = [clf._media_key(i, r, call_id) for i, r in enumerate(requests)]
        return cls(clf, requests, call_id, scheduler, key_groups(keys, order), [None] * len(requests))

    @property
    def budget(self) -> int:
        return self.scheduler.budget

    @property
    def done(self) -> bool:
        return self.next_prepare == len(self.groups)

    def start(self) -> None:
        """Before the first step: its towers, then the prompts it takes (the towers are device work that needs none of
        the prompts' host work; the prompts of later steps are built while its pass runs)."""
        self.start_towers(self.budget)
        self.admit(self.budget)

    def ahead(self, batch: list[ScheduledSlice]) -> StepAhead:
        """The host work for the steps after `batch`, to do while its pass runs. The next step first continues the
        running prompts (what `batch` leaves of them), then admits new ones."""
        carried = sum(seq.remaining for seq in self.scheduler.running) - sum(s.num_new for s in batch)
        return StepAhead(self, self.budget - carried)

    def start_towers(self, budget: int, most: int | None = None) -> int:
        """Start the towers of the clips a step of `budget` new tokens reaches, in admission order (at most `most` of
        them): each clip while the video tokens before it stay under the budget (the clip a step's end cuts is
        encoded whole). A clip with features or a tail already kept, whose input fails its check, whose video alone
        fills `max_model_len`, or whose requests are done or failed, needs none (failures are reported by the
        preparation). Returns the budget left."""
        started = 0
        while self.next_tower < len(self.groups) and budget > 0 and (most is None or started < most):
            group = self.groups[self.next_tower]
            plan = self._needs_tower(group)
            if plan is not None:
                self.clf._encode(group.key, self.requests[group.indices[0]].clip, plan.grid_thw)
                self.started.add(group.key)
                budget -= plan.num_tokens
                started += 1
            self.next_tower += 1
        return budget

    def _needs_tower(self, group: KeyGroup) -> VideoPlan | None:
        """The clip's plan when its tower should start now, else None (see `start_towers`)."""
        if group.key in self.started or group.key in self.closed or self.clf._features.holds(group.key):
            return None
        try:
            plan = self.clf._clip_plan(self.requests[group.indices[0]].clip)
        except ValueError:
            return None
        return plan if plan.num_tokens < self.clf.config.max_model_len else None

    def admit(self, tokens: int, most: int | None = None) -> bool:
        """Build the prompts of whole groups (at most `most` of them), in order, until the requests waiting to be
        scheduled hold about `tokens` new tokens (`new_tokens`), or every group is in. A group none of whose
        requests can be prepared is closed, its tower (if started ahead) released. Returns whether it took any."""
        waiting = self._waiting_tokens()
        took = 0
        while self.next_prepare < len(self.groups) and waiting < tokens and (most is None or took < most):
            waiting += self._admit_group()
            took += 1
        return took > 0

    def refill(self) -> bool:
        """The scheduler's `refill`: one more group, for a step that took every waiting prompt with budget left
        (`new_tokens` overcounts a prompt whose prefix is cached). False when every group is in."""
        if self.done:
            return False
        self._admit_group()
        return True

    def _admit_group(self) -> int:
        """Build the next group's prompts into the scheduler; returns their estimated new tokens."""
        group = self.groups[self.next_prepare]
        self.next_prepare += 1
        admitted = []
        for i in group.indices:
            request = self.requests[i]
            try:
                seq = self.clf._prepare(i, request, self.call_id)
            except ValueError as exc:
                self.results[i] = ClassifyResult(request.request_id, None, [], 0, 0, error=str(exc))
                continue
            self.scheduler.add(seq)
            admitted.append(seq)
        if admitted:
            self.pending[group.key] = self.pending.get(group.key, 0) + len(admitted)
        else:
            self.close(group.key)
        return sum(new_tokens(seq, follows=n > 0) for n, seq in enumerate(admitted))

    def _waiting_tokens(self) -> int:
        seen: set[str] = set()
        total = 0
        for seq in self.scheduler.waiting:
            total += new_tokens(seq, follows=seq.media_key in seen or self.scheduler.has_leader(seq.media_key))
            seen.add(seq.media_key)
        return total

    def finished(self, key: str) -> bool:
        """One of `key`'s requests finished; True when it was the last one in flight."""
        self.pending[key] -= 1
        if self.pending[key]:
            return False
        del self.pending[key]
        self.closed.add(key)
        return True

    def close(self, key: str) -> None:
        """Nothing will read `key`'s features: drop them if a tower was started for them."""
        self.closed.add(key)
        self.clf._features.release_clip(key, 0, keep_tail=False)

    def abandon(self) -> None:
        """After an exception: drop the features of every key still in flight or started ahead."""
        for key in set(self.pending) | (self.started - self.closed):
            self.clf._features.release_clip(key, 0, keep_tail=False)
        self.pending.clear()


@dataclass
class StepAhead:
    """The host work for the steps after a scheduled pass, in pieces: the next step's towers, one clip a piece, then
    prompts until those waiting hold ADMIT_STEPS steps' tokens, one clip's requests a piece. `runner.forward` does a
    piece at each wait on the pass's layers (`piece`, its `on_wait`: the layers queued then cover it), and once the
    whole pass is queued (its `on_queued`) either the rest (`finish`) or, when the next pass is queued behind this
    one before its logits are read, the next step's towers only (`towers`): the prompts left are built at the next
    pass's waits, and those the next step takes at once as it is scheduled (`CallIntake.refill`)."""

    intake: CallIntake
    tower_budget: int   # new tokens of the next step whose clips' towers are yet to be started

    def piece(self) -> bool:
        """One piece of the work; False when none is left."""
        intake = self.intake
        if self.tower_budget > 0 and intake.next_tower < len(intake.groups):
            self.tower_budget = intake.start_towers(self.tower_budget, most=1)
            return True
        return intake.admit(ADMIT_STEPS * intake.budget, most=1)

    def finish(self) -> None:
        while self.piece():
            pass

    def towers(self) -> None:
        if self.tower_budget > 0:
            self.tower_budget = self.intake.start_towers(self.tower_budget)
