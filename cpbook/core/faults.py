"""Which rank failed a torchrun job, and why: the one line :func:`cpbook.core.launch.run` raises.

Three faults, three ways to find the guilty rank:

* **a rank raises** — its worker writes an error file whose first lines are the rank and the
  exception's type and message (:func:`summary`); the traceback follows (shown with
  ``--debug``);
* **a rank is killed** (a signal, the OOM killer, a crash) — it leaves a pid file and neither a
  result, an error file nor the mark a worker leaves when torchrun stops it (SIGTERM);
  torchrun's own failure report (``exitcode: -9 (pid: …)``) gives the signal
  (:func:`exit_codes`);
* **a rank stops answering** (blocks outside any collective) — its peers' collectives time
  out.  Each peer records in the job's store which call it waited in (``op``, group, the
  group's call count: :attr:`cpbook.core.comm.CommTimeout.where`) and waits a short grace
  for the other members' records; the members that recorded nothing never entered that call,
  and they are the ones blamed (:func:`blame`), not the peer that timed out first.

Each error file reads ``<rank blamed> <kind>`` then the one-line summary then the detail;
:func:`raise_failure` (the launcher, after torchrun exits) picks the root cause: a rank's own
exception, then a killed rank, then the rank its peers blamed, then a broken collective.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from cpbook.core.nodes import ROOT_KEY, is_consequence, job_store, report_root, root_cause

__all__ = ["WAIT_KEY", "blame", "exit_codes", "raise_failure", "silent_ranks", "summary"]

WAIT_KEY = "cpbook/wait/"
#: the order in which a failure's kind explains the job's failure (lower: the root cause)
_PRIORITY = {"raised": 0, "root": 1, "killed": 2, "blamed": 3, "lost": 4, "broken": 5}
_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


def summary(e: BaseException) -> str:
    """``Type: first line of the message`` — what the one-line error shows of ``e``."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _waits(store, ranks: list[int]) -> dict[int, dict]:
    out = {}
    for r in ranks:
        key = f"{WAIT_KEY}{r}"
        if store.check([key]):
            out[r] = json.loads(store.get(key))
    return out


def blame(rank: int, where: dict, grace: float) -> tuple[list[int] | None, str]:
    """For this ``rank`` whose call ``where`` (:attr:`CommTimeout.where`) failed: record it in
    the job's store, wait up to ``grace`` seconds for the group's other members' records, and
    return ``(blamed ranks, one line)`` — the members that recorded nothing (they never entered
    the call), else those waiting in another call.  ``(None, text)`` when another rank already
    published the job's root cause (a rank that raised or died): ``text`` is that cause."""
    store = job_store(5.0)
    store.set(f"{WAIT_KEY}{rank}", json.dumps(where))
    others = [r for r in where["ranks"] if r != rank]
    deadline = time.monotonic() + grace
    while True:
        if store.check([ROOT_KEY]):
            return None, store.get(ROOT_KEY).decode()
        seen = _waits(store, others)
        if len(seen) == len(others) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    call = f"{where['op']} #{where['call']} on group {where['group']!r} {where['ranks']}"
    missing = [r for r in others if r not in seen]
    if missing:
        entered = sorted(set(where["ranks"]) - set(missing))
        return missing, (
            f"stopped answering: rank {rank} waited for rank(s) {missing} in {call} (timeout "
            f"{where['timeout']:g} s); they never entered it, ranks {entered} did"
        )
    elsewhere = {
        r: w for r, w in seen.items() if (w["group"], w["call"]) != (where["group"], where["call"])
    }
    if elsewhere:
        r, w = sorted(elsewhere.items())[0]
        return sorted(elsewhere), (
            f"waits elsewhere: rank {rank} waited in {call} while rank {r} waited in "
            f"{w['op']} #{w['call']} on group {w['group']!r} (the ranks' calls disagree)"
        )
    return [], f"every rank of {call} entered it and timed out"


def error_text(rank: int, e: BaseException, tb: str, timeout: float) -> str:
    """The error file of this worker, whose function raised ``e`` (traceback ``tb``):
    ``"<rank blamed> <kind>\\n<one line>\\n<detail>"``.  Its own exception is published as the
    job's root cause; a failed collective looks for the rank behind it (:func:`blame`)."""
    line = summary(e)
    if not is_consequence(e):
        report_root(rank, f"{line}\n{tb}")
        return f"{rank} raised\n{line}\n{tb}"
    where = getattr(e, "where", None)
    try:
        blamed, text = blame(rank, where, min(timeout, 10.0)) if where else ([], "")
    except Exception:  # noqa: BLE001 - no store (it left with its node): report our own error
        blamed, text = [], ""
    if not where:  # a failure outside a timed call: wait a little for a published cause
        found = root_cause(min(timeout, 10.0))
        if found is not None and found[0] != rank:
            blamed, text = None, f"{found[0]}\n{found[1]}"
    if blamed is None:  # another rank raised or died first: its published cause
        who, _, cause = text.partition("\n")
        return f"{who} root\n{cause}\n(rank {rank} saw its collective fail: {line})"
    if blamed:
        report_root(blamed[0], f"{text}\n{line}")
        return f"{blamed[0]} blamed\n{text}\n{line}\n{tb}"
    return f"{rank} broken\n{line}{'; ' + text if text else ''}\n{tb}"


def exit_codes(torchrun_stderr: str) -> dict[int, int]:
    """``{pid: exit code}`` of the workers torchrun reports as failed (negative: a signal)."""
    return {int(pid): int(code) for code, pid in _EXIT.findall(torchrun_stderr)}


def silent_ranks(tmp: str) -> list[tuple[int, int]]:
    """``(rank, pid)`` of every worker that left a pid file but no result, no error file and no
    mark of being stopped by torchrun: killed or crashed."""
    out = []
    for p in sorted(Path(tmp).glob("pid_rank*.txt")):
        rank = int(p.stem.removeprefix("pid_rank"))
        done = [Path(tmp, f"{k}_rank{rank}.{e}") for k, e in (("result", "pt"), ("error", "txt"))]
        if any(d.exists() for d in done) or Path(tmp, f"term_rank{rank}").exists():
            continue
        out.append((rank, int(p.read_text().split()[0])))
    return out


def _death(pid: int, code: int | None) -> str:
    head = "ended without a result or a Python error:"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"{head} killed by signal {-code} ({name}), pid {pid}"
    if code is not None:
        return f"{head} exited with code {code}, pid {pid}"
    return f"{head} killed by a signal or crashed, pid {pid}"


def raise_failure(name: str, world_size: int, tmp: str, stderr: str, dead=None) -> None:
    """Raise ``RuntimeError("rank R of N failed in NAME under torchrun: <one line>\\n<detail>")``
    for the job's root cause, if any rank failed (see the module docstring's order); ``dead``
    is a ``(rank, text)`` the multi-node launcher already found."""
    found = []
    for p in Path(tmp).glob("error_rank*.txt"):
        head, _, rest = p.read_text().partition("\n")
        who, _, kind = head.partition(" ")
        line, _, detail = rest.partition("\n")
        if kind == "blamed" and Path(tmp, f"result_rank{who}.pt").exists():
            # the rank waited for returned without entering the call: the waiting rank's error
            own, _, detail = detail.partition("\n")
            kind, line = "broken", f"{own} (rank {who} returned without entering that call)"
            who = p.stem.removeprefix("error_rank")
        found.append((_PRIORITY.get(kind, 5), p.stat().st_mtime_ns, int(who), line, detail))
    codes = exit_codes(stderr)
    for rank, pid in silent_ranks(tmp):
        kind = "killed" if pid in codes else "lost"
        found.append((_PRIORITY[kind], 0, rank, _death(pid, codes.get(pid)), ""))
    if dead is not None and not any(f[2] == dead[0] for f in found):
        found.append((_PRIORITY["killed"], 0, dead[0], dead[1].splitlines()[0], dead[1]))
    if not found:
        return
    _, _, rank, line, detail = min(found, key=lambda f: f[:2])
    raise RuntimeError(
        f"rank {rank} of {world_size} failed in {name} under torchrun: {line}\n{detail}"
    )
