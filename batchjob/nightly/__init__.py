"""Nightly jobs as teams run them: a definition, run history, night-over-night diff, schedules, a report."""
