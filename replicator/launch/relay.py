"""What the launcher shows of a worker's output: chatter left out, errors after a failure condensed, all of it logged.

Every line a worker prints goes, as it printed it, to its log file
(``worker-I.log`` in the job's log directory, :func:`log_path`), and to the
launcher's own output with a ``[worker I] `` prefix, except:

* **Runtime chatter** (:data:`CHATTER`): lines that libraries print on every
  start and that say nothing about the job, such as Gloo's ``[Gloo] Rank 0 is
  connected to 1 peer ranks ...`` (eight of them for a 2 x 2 job on CPU). Left
  out unless ``--show-runtime-logs``; always in the log file.
* **Errors, held until the launcher has spoken.** A worker's stderr line that
  starts an error report (:func:`starts_error`: a Python traceback, a fatal or
  error line of XLA's logging, its ``Check failure stack trace``) and what
  follows it on stderr are held back. If the job fails, the launcher's
  diagnosis comes first: then the blamed worker's held lines in full, and for
  every other worker one line (:func:`summarize`: the exception it raised, a
  consequence of the failure) that names its log file. If the job goes on (a
  traceback that the script caught and printed), the held lines are shown
  :data:`HOLD_S` seconds after the last one, in order.

stdout is never held: what a script prints there, training logs included,
shows at once.

>>> strip_chatter("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3") is None
True
>>> strip_chatter("step 3 loss 0.25")
'step 3 loss 0.25'
>>> summarize(["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
...            "jax.errors.JaxRuntimeError: UNKNOWN: Gloo all-reduce failed", "replicator: worker 0 stopped"])
'jax.errors.JaxRuntimeError: UNKNOWN: Gloo all-reduce failed'

Promises:

1. Every line goes to the worker's log file as printed, chatter included;
   the chatter is left out of the launcher's output unless
   ``show_runtime_logs`` (tests/test_launch_cli.py::TestChatter::test_worker_log,
   tests/test_launch_cli.py::TestJobOutput::test_chatter_is_left_out_unless_asked_for_and_always_logged).
2. Chatter is cut out wherever it is in a line, the rest of the line kept; a
   line that only looks like it is kept
   (tests/test_launch_cli.py::TestChatter::test_gloo_lines_are_chatter).
3. stdout is never held, not even a traceback, not even after a failure
   (tests/test_relay_promises.py::test_stdout_is_never_held).
4. A stderr error report and the stderr after it are held while the job
   runs, and shown in order :data:`HOLD_S` seconds after the last of them,
   not before (tests/test_relay_promises.py::test_an_error_report_is_held_until_hold_s_after_its_last_line_then_shown_in_order,
   tests/test_launch_cli.py::TestJobOutput::test_a_traceback_that_the_script_caught_is_shown).
5. When the job fails, the blamed worker's held lines are shown in full after
   the launcher's diagnosis; every other worker's stderr from then on is held
   and shown as one line that names its log file and how many lines it holds
   (tests/test_relay_promises.py::test_after_a_failure_the_blamed_worker_shows_its_report_and_the_others_one_line,
   tests/test_launch_cli.py::TestJobOutput::test_the_diagnosis_first_and_the_consequences_condensed).
6. The one line is the exception the last traceback ended with; else XLA's
   first fatal line, its first error line, the first line that starts a
   report, the first non-empty line; at most 300 characters
   (tests/test_relay_promises.py::test_the_summary_of_an_error_report,
   tests/test_launch_cli.py::TestChatter::test_error_reports).
7. A worker's log is ``worker-I.log``, and ``worker-I.restart-R.log`` after
   restart ``R`` (tests/test_relay_promises.py::test_log_files_are_named_by_worker_and_start).
8. A log file that cannot be written (a full disk) does not stop the lines
   shown, nor the log's closing (tests/test_relay_promises.py::test_a_log_file_that_cannot_be_written_does_not_stop_the_output,
   tests/test_relay_promises.py::test_closing_a_log_file_that_cannot_be_written_is_no_error).
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import IO

__all__ = ["CHATTER", "HOLD_S", "WorkerLog", "log_path", "starts_error", "strip_chatter", "summarize"]

#: Runtime chatter: printed on every start by libraries under JAX, never about the job.
#: Gloo's line comes once per communicator (per worker, and per device of it on CPU).
CHATTER: tuple[re.Pattern[str], ...] = (
    re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+"),
)

#: A line that starts an error report: a Python traceback, ``Fatal Python error``, XLA's (absl's)
#: fatal and error log lines (``F1125 19:10:03.123456  8630 file.cc:77] ...``), its check-failure trace.
_ERROR_START = re.compile(
    r"^(Traceback \(most recent call last\):"
    r"|Fatal Python error: "
    r"|\*\*\* Check failure stack trace: \*\*\*"
    r"|[EF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] )"
)
_LOG_LINE = re.compile(r"^([EF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] (.*)$")

#: Held error lines of a worker that goes on running are shown this long after the last one: a
#: worker that raised has exited well within it (the exception hook of ``initialize()`` exits at once).
HOLD_S = 2.0
_SUMMARY_CHARS = 300


def strip_chatter(line: str) -> str | None:
    """``line`` without runtime chatter (:data:`CHATTER`); None when chatter was all it held.

    A chatter message is cut out wherever it is in the line: a library's message
    and the script's own output can share a line when both print at once.
    """
    rest = line
    for pattern in CHATTER:
        rest = pattern.sub("", rest)
    if rest is line or rest == line:
        return line
    return rest if rest.strip() else None


def starts_error(line: str) -> bool:
    """Whether a stderr line starts an error report (a traceback, a fatal log line, a check failure)."""
    return bool(_ERROR_START.match(line))


def summarize(lines: list[str]) -> str:
    """One line for an error report: the exception the last traceback ended with, else XLA's fatal message.

    Falls back to the first error line, then the first line.
    """
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:
        for line in lines[starts[-1] + 1 :]:
            if line and not line[0].isspace():  # the frames are indented; the exception line is not
                return _cut(line)
    fatal = [m.group(2) for m in map(_LOG_LINE.match, lines) if m and m.group(1) == "F"]
    errors = [m.group(2) for m in map(_LOG_LINE.match, lines) if m]
    for candidates in (fatal, errors, [line for line in lines if starts_error(line)], [x for x in lines if x.strip()]):
        if candidates:
            return _cut(candidates[0])
    return ""


def _cut(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SUMMARY_CHARS else text[:_SUMMARY_CHARS] + " ..."


def log_path(directory: str, worker_id: int, restart: int) -> str:
    """Where worker ``worker_id``'s output of the job's start ``restart`` is kept."""
    name = f"worker-{worker_id}.log" if restart == 0 else f"worker-{worker_id}.restart-{restart}.log"
    return os.path.join(directory, name)


class WorkerLog:
    """One worker's output: to its log file, all of it; to the launcher's output, filtered and ordered.

    The output threads call :meth:`line`; the supervision loop calls
    :meth:`release_stale` while the job runs and :meth:`settle` when it fails;
    :meth:`close` after the worker's output ended.

    Args:
      worker_id: the worker, for the prefix.
      write: ``write(to_stderr, text)``: puts a whole prefixed line (with its
        newline) on the launcher's stdout or stderr.
      path: the log file (None: none is kept).
      show_runtime_logs: show the chatter too.
    """

    def __init__(self, worker_id: int, write, path: str | None, *, show_runtime_logs: bool = False):
        self.worker_id = worker_id
        self.prefix = f"[worker {worker_id}] "
        self.path = path
        self.show_runtime_logs = show_runtime_logs
        self._write = write
        self._file: IO[str] | None = open(path, "w", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._held: list[str] = []
        self._held_at = 0.0
        self._mode = "live"  # 'live' | 'condense' (the job failed and this worker is not blamed)
        self.lines = 0  # written to the log file
        self.condensed = False  # whether a condensed line named the log file

    def line(self, text: str, *, stderr: bool) -> None:
        """A line the worker printed (without its newline)."""
        with self._lock:
            self.lines += 1
            if self._file is not None:
                try:
                    self._file.write(text + "\n")
                except (OSError, ValueError):  # a full disk must not stop the job's output
                    pass
            if not self.show_runtime_logs:
                shown = strip_chatter(text)
                if shown is None:
                    return
                text = shown
            if stderr and (self._held or self._mode == "condense" or starts_error(text)):
                self._held.append(text)
                self._held_at = time.monotonic()
                return
            self._write(stderr, f"{self.prefix}{text}\n")

    def release_stale(self, now: float) -> None:
        """Show held lines whose worker went on: none came for :data:`HOLD_S` seconds and the job has not failed."""
        with self._lock:
            if self._held and self._mode == "live" and now - self._held_at >= HOLD_S:
                self._release()

    def settle(self, blamed: bool) -> None:
        """The job failed and the launcher said why: the blamed worker's held lines now, the others' at :meth:`close`.

        A worker that is not blamed holds all its stderr from now on: what it
        prints after a peer's failure is a consequence of it.
        """
        with self._lock:
            if blamed:
                self._release()
            else:
                self._mode = "condense"

    def close(self, blamed: bool | None = None) -> None:
        """The worker's output ended: show what is held (condensed after a failure), close the log file."""
        with self._lock:
            if self._held:
                if self._mode == "condense" and not blamed:
                    n = len(self._held)
                    lines = f"{n} line{'s' if n != 1 else ''}"
                    where = f" ({lines} in full: {self.path})" if self.path else f" ({lines} not shown)"
                    self.condensed = bool(self.path)
                    self._write(
                        True, f"[launcher] worker {self.worker_id}, after the failure: {summarize(self._held)}{where}\n"
                    )
                    self._held = []
                else:
                    self._release()
            if self._file is not None:
                try:
                    self._file.close()  # its last flush: may fail on a full disk, like any write to it
                except OSError:
                    pass
                self._file = None

    def _release(self) -> None:
        for text in self._held:
            self._write(True, f"{self.prefix}{text}\n")
        self._held = []
