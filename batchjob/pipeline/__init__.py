"""The job runtime: dataset rows -> Ray decode actors -> engine actor(s) -> resumable Parquet output.

Modules: `work` (pure logic: clips, rows), `output` (atomic parts, verified reads, lock), `resume` (skip,
answer again or re-score the rows already written), `retry` (replacing rows in place), `actors` (Ray actors),
`workers` (the driver's seam to them), `driver` (bounded streaming loop), `engines` (engine registry / plugin
seam), `mlx_engine` and `vllm_engine` (the two engines behind `batchjob.contract.Engine`), `ray_runtime`
(local or cluster Ray), `job` (one run from config to output), `report` (summary from the Parquet alone).
Ray is imported lazily so `validate` and `report` work without starting it.
"""
from batchjob.pipeline.driver import RunStats
from batchjob.pipeline.job import RunOptions, run_job
from batchjob.preflight import preflight
from batchjob.pipeline.report import summarize

__all__ = ["RunOptions", "RunStats", "preflight", "run_job", "summarize"]
