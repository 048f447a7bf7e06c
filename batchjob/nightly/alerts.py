"""What fails a night, and the summary a person reads in the morning (pure functions)."""
from __future__ import annotations

from batchjob.nightly.definition import AlertConfig
from batchjob.nightly.history import RunRecord

RUN_EXIT = {0: "done", 1: "runtime failure, too many error rows, or another run holds the output",
            2: "bad config or damaged output: fix it, then rerun", 130: "interrupted", 143: "terminated"}


def alerts_for(accuracy: float | None, rows_answered: int, error_rows: int, exit_status: int,
               previous: RunRecord | None, alert: AlertConfig) -> list[str]:
    """Reasons this job run fails the night; empty when it does not.

    The error rate is over the rows this run answered (a resumed run that had nothing left to do has
    none); the accuracy drop is against the job's previous normal run.
    """
    out = []
    if exit_status != 0:
        out.append(f"batchjob run exited {exit_status} ({RUN_EXIT.get(exit_status, 'failed')})")
    if alert.max_error_rate is not None and rows_answered:
        rate = error_rows / rows_answered
        if rate > alert.max_error_rate:
            out.append(f"error rate {rate:.2%} ({error_rows} of {rows_answered} rows) above "
                       f"max_error_rate {alert.max_error_rate:.2%}")
    if alert.max_accuracy_drop is not None and previous is not None and accuracy is not None \
            and previous.accuracy is not None:
        drop = previous.accuracy - accuracy
        if drop > alert.max_accuracy_drop + 1e-12:
            out.append(f"accuracy {accuracy:.4f} fell {drop:.4f} from {previous.accuracy:.4f} "
                       f"(night {previous.night}), above max_accuracy_drop {alert.max_accuracy_drop:.4f}")
    return out


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def night_summary(name: str, night: str, records: list[RunRecord], previous: dict[str, RunRecord | None],
                  problems: list[str] = ()) -> str:
    """Plain text (it goes to mail and webhooks): one line per job, then every alert."""
    failed = [r for r in records if r.failed] or problems
    lines = [f"batchjob nightly {name!r}, night {night}: {'FAILED' if failed else 'ok'} "
             f"({len(records)} job run(s))"]
    for r in records:
        prev = previous.get(r.job)
        delta = (f" ({r.accuracy - prev.accuracy:+.4f} vs {prev.night})"
                 if prev is not None and prev.accuracy is not None and r.accuracy is not None else "")
        lines.append(f"  {r.job}: exit {r.exit_status}, accuracy {_fmt(r.accuracy)}{delta}, "
                     f"{r.rows_answered} rows answered, {r.error_rows} errors, {_fmt(r.rows_per_s, '.2f')} rows/s, "
                     f"output {r.output}")
    alerts = [f"  {r.job}: {a}" for r in records for a in r.alerts] + [f"  {p}" for p in problems]
    if alerts:
        lines.append("alerts:")
        lines.extend(alerts)
    for r in records:
        if r.log:
            lines.append(f"log {r.job}: {r.log}")
    return "\n".join(lines) + "\n"
