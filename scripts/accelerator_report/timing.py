"""The clocks of a report's process: the log's, from the process's start, and its job's (`job_seconds`)."""

import sys
import time

START = time.perf_counter()
_job_start = START  # what a job's `import_s` and `ready_s` count from: its process's start, or its fork's


def log(message):
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


def start_job_clock():
    """A forked job's figures count from its fork, not from its parent's start."""
    global _job_start
    _job_start = time.perf_counter()


def job_seconds() -> float:
    """Seconds since this job's process (or its fork) started."""
    return time.perf_counter() - _job_start


def timed(call, repeats):
    """(first call's seconds, [timed calls' seconds])."""
    start = time.perf_counter()
    call(0)
    first = time.perf_counter() - start
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(i + 1)
        times.append(time.perf_counter() - start)
    return first, times
