"""Jobs: the in-memory tracker policies read (``tracker``, pure) and the persisted
per-job event log (``history``, store-backed, for the runtime and inspection)."""

from sidecar.jobs.tracker import (
    DEFAULT_MAX_JOBS,
    JobTracker,
    MeasuredToolTime,
    effective_job_id,
)

__all__ = ["DEFAULT_MAX_JOBS", "JobTracker", "MeasuredToolTime", "effective_job_id"]
