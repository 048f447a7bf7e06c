"""How the driver reaches its decoders and engines: a narrow seam, so the driver's logic runs without Ray.

`RayWorkers` is the real thing (actor handles, ObjectRefs, `ray.wait`); tests drive the same `Driver` with
an in-process fake. Failures come back as two exceptions the driver understands: the worker's process is
gone (`WorkerLost`: a crashing codec, a timeout kill), or the task raised (`TaskFailed`).
"""
from __future__ import annotations

from typing import Any, Hashable, Protocol, Sequence

from batchjob.contract import EngineClip


class WorkerLost(Exception):
    """The worker's process died (or was killed) while it held the task."""


class TaskFailed(Exception):
    """The task raised, or its result could not be stored; the message names the cause."""


class Workers(Protocol):
    """Tickets are opaque hashable handles for results that arrive later."""

    num_decoders: int
    num_engines: int

    def decode(self, decoder: int, video: str) -> tuple[Hashable, Any]:
        """(status ticket, payload handle): the payload goes to an engine without passing through the driver."""

    def answer(self, engine: int, clips: Sequence[EngineClip], payloads: Sequence[Any]) -> Hashable: ...

    def probe(self, decoder: int) -> Hashable:
        """A trivial call whose result says whether a restarted decoder is back."""

    def wait(self, tickets: Sequence[Hashable], timeout: float) -> list[Hashable]:
        """The tickets whose results are ready (all of them that are, waiting up to `timeout` for the first)."""

    def result(self, ticket: Hashable) -> Any:
        """The value; raises WorkerLost or TaskFailed."""

    def kill_decoder(self, decoder: int) -> None:
        """Kill a stuck decoder's process (it restarts); its pending ticket then raises WorkerLost."""


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


class RayWorkers:
    """Decoder and engine actors (see batchjob.pipeline.actors) behind the `Workers` seam."""

    def __init__(self, decoders: list, engines: list):
        self.decoders, self.engines = decoders, engines
        self.num_decoders, self.num_engines = len(decoders), len(engines)

    def decode(self, decoder: int, video: str) -> tuple[Hashable, Any]:
        status_ref, payload_ref = self.decoders[decoder].decode.options(num_returns=2).remote(video)
        return status_ref, payload_ref

    def answer(self, engine: int, clips: Sequence[EngineClip], payloads: Sequence[Any]) -> Hashable:
        # Payload refs as top-level arguments: Ray resolves them in the engine's process.
        return self.engines[engine].answer.remote(list(clips), *payloads)

    def probe(self, decoder: int) -> Hashable:
        return self.decoders[decoder].node_id.remote()

    def wait(self, tickets: Sequence[Hashable], timeout: float) -> list[Hashable]:
        import ray

        ready, _ = ray.wait(list(tickets), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(list(tickets), num_returns=len(tickets), timeout=0)
        return ready

    def result(self, ticket: Hashable) -> Any:
        import ray

        try:
            return ray.get(ticket)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ActorUnavailableError) as err:
            raise WorkerLost(type(err).__name__) from None
        except ray.exceptions.RayError as err:
            # A task error wraps the worker's exception; name that, not Ray's traceback.
            cause = getattr(err, "cause", None) or err
            raise TaskFailed(f"{type(cause).__name__}: {_first_line(cause)}") from None

    def kill_decoder(self, decoder: int) -> None:
        import ray

        ray.kill(self.decoders[decoder], no_restart=False)
