"""Bounded waits: a dead or stalled peer stops the ``cuda_symm`` kernels with a stated reason
instead of hanging the GPU for ever.

The fused kernels, the Lamport one-shot and the push variant's push wait for their peers by
spinning on signal slots (or, Lamport, on the data itself) in GPU memory. A peer that died, stalled
or runs other collectives never sends, and nothing on the host can stop a spinning kernel: before
these limits the surviving ranks hung with no error, where plain NCCL collectives fail after the
process group's timeout (PyTorch's NCCL watchdog aborts them; 10 minutes by default).

Every spin loop therefore carries a deadline (``kernels._give_up_after``): ``timeout_ns`` after the
wait began, read from the GPU's ``%globaltimer``. Past it the kernel writes a record of who waited for
whom, and where, into a small pinned host buffer (``record_address``: the GPU stores into it through
unified addressing) and executes ``trap``. That ends the kernel and leaves the CUDA context failed,
so the next CUDA call of the process raises ("unspecified launch failure") and no later work runs on
rows that were never reduced: no wrong answer, and no hang. A watcher thread (and an ``atexit`` check,
for a process the error ends at once) turns the record into the message ``describe`` writes, logged
at ERROR on the ``weavepass`` logger (printed to stderr where no logging is set up).

The limit is the process group's own timeout, so weave gives up when NCCL would
(``peer_timeout_ns``); ``WEAVE_PEER_TIMEOUT_S`` overrides it (``0``: wait for ever, as before).
A wait is measured on the GPU from the moment the kernel starts waiting, so it never ends earlier
than the host-side NCCL timer, which starts when the collective is queued.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

import torch

logger = logging.getLogger("weavepass")

TIMEOUT_ENV = "WEAVE_PEER_TIMEOUT_S"

RECORD_SLOTS = 8
"""int32 slots of the record: ``[FLAG, RANK, PEER, SITE, WORLD, TIMEOUT_S]`` (two spare)."""
FLAG, RANK, PEER, SITE, WORLD, TIMEOUT_S = range(6)

SITES = {
    1: "the two-shot barrier's send: the peer has not taken this rank's previous signal",
    2: "the two-shot barrier: the peer's signal never came",
    3: "the pipelined kernel's chunk counters: the peer's rows never came",
    4: "the Lamport one-shot: the peer's rows never came",
    5: "the push variant's push: the peer never finished reading this rank's previous rows",
    6: "the push variant's push: the peer's rows never came",
    7: "the scatter GEMM: the peer never finished reading this rank's previous rows (runtime.cuda.gemm)",
    8: "the scatter GEMM's reduce: the peer's tiles of a row block never came (runtime.cuda.gemm)",
    9: "the matmul op's gather: the peer's normed rows never came (runtime.cuda.gemm.collect_rows)",
    10: "the gather prologue's push: the peer's gather GEMM never finished reading this rank's previous rows "
        "(runtime.cuda.gather)",
    11: "the gather GEMM: the owner's rows of a row block never came (runtime.cuda.gather)",
}
"""What each wait site of ``weavepass.runtime.cuda.kernels`` waits for (the ``SITE`` code)."""

_LOCK = threading.Lock()
_RECORD: torch.Tensor | None = None
_REPORTED = False


def peer_timeout_ns(group_name: str | None) -> int:
    """How long a kernel of this group waits for a peer before giving up, in ns (0: for ever).

    ``WEAVE_PEER_TIMEOUT_S`` if set, else the process group's own timeout (what its NCCL
    collectives would wait; ``portable.DEFAULT_GROUP_TIMEOUT_S`` where it cannot be read)."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is not None and text.strip():
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds (0 waits for ever)") from None
        if not (seconds == 0 or 1e-3 <= seconds < 1e9):  # NaN fails both
            raise ValueError(f"{TIMEOUT_ENV}={text!r} must be 0 (wait for ever) or 0.001 seconds or more")
        return int(seconds * 1e9)
    from weavepass.runtime.portable import group_timeout_s

    return int(group_timeout_s(group_name) * 1e9)


def record_address() -> int:
    """The device-visible address of this process's pinned record (allocated, and the watcher
    started, on first use). 0 without CUDA: the kernels then trap without a record."""
    global _RECORD
    with _LOCK:
        if _RECORD is None:
            if not torch.cuda.is_available():
                return 0
            _RECORD = torch.zeros(RECORD_SLOTS, dtype=torch.int32, pin_memory=True)
            threading.Thread(target=_watch, name="weave-peer-wait", daemon=True).start()
            atexit.register(check_record)
        return _RECORD.data_ptr()


def describe(record: torch.Tensor) -> str | None:
    """The message for a record a kernel wrote (``record`` as ``RECORD_SLOTS`` int32), or None
    while nothing gave up."""
    values = [int(v) for v in record.tolist()]
    if values[FLAG] == 0:
        return None
    site = SITES.get(values[SITE], f"wait site {values[SITE]}")
    return (
        f"weave: rank {values[RANK]} of a {values[WORLD]}-rank group waited {values[TIMEOUT_S]} s for rank "
        f"{values[PEER]} inside the fused all-reduce kernel ({site}) and stopped the GPU, so the next CUDA "
        "call of this process fails ('unspecified launch failure') instead of hanging. The peer died, "
        "stalled, or runs different collectives from this rank (a graph or a step that only some ranks "
        "run). The limit is the process group's timeout, the same a plain NCCL collective would wait; "
        f"set {TIMEOUT_ENV} to change it (0 waits for ever)."
    )


def check_record() -> str | None:
    """Report the record once, if a kernel wrote one (the watcher and ``atexit`` call this)."""
    global _REPORTED
    record = _RECORD
    if record is None or _REPORTED:
        return None
    message = describe(record)
    if message is not None:
        _REPORTED = True
        if _logged_somewhere(logger):
            logger.error(message)
        else:  # weavepass's own NullHandler only: nobody would see the log record
            print(message, file=sys.stderr, flush=True)
    return message


def _logged_somewhere(log: logging.Logger) -> bool:
    """Whether a record of ``log`` reaches a handler that writes it (the package adds a
    ``NullHandler``, so ``hasHandlers`` is true even where logging was never set up)."""
    while log is not None:
        if any(not isinstance(h, logging.NullHandler) for h in log.handlers):
            return True
        log = log.parent if log.propagate else None
    return False


def _watch(interval_s: float = 1.0) -> None:
    event = threading.Event()
    while not _REPORTED:
        event.wait(interval_s)
        check_record()
