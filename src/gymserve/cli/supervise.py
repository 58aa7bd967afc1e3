"""``gymserve serve`` as a thin supervising parent: the server runs in a child process, and a child
that a signal kills (SIGSEGV in llama.cpp's native code, SIGABRT, the kernel's OOM killer) becomes
one line saying what happened and where the details are, and a non-zero exit, instead of a bare
``Segmentation fault`` from the shell.

Why a parent at all: a crash in native code inside the server's process cannot be caught there
(Python's ``faulthandler`` can print the backtrace of every thread on the way down, and does: the
child enables it, to its stderr, which is the parent's). Only another process can see the death
and say so. The engine itself stays in the server's process (the in-process design): a child-process
engine, as vLLM runs its engine core, would let the server survive and restart the engine, at the
cost of moving every token and log-prob across a process boundary; that is out of scope here
(docs/model-servers/local.md, "Engine faults").

What the parent does: starts ``python -m gymserve.cli ARGS...`` with ``GYMSERVE_SERVE_CHILD=1``
(the child then serves in-process; set it yourself to run without the parent), in its own process
group so that a terminal's Ctrl-C reaches the server once, through the parent; forwards SIGINT,
SIGTERM and SIGHUP to it; and returns its exit status. On Linux the child gets SIGTERM when the
parent dies (``PR_SET_PDEATHSIG``), so killing the parent, even with SIGKILL, never leaves a server
behind. The child's stdout and stderr are the parent's own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

CHILD_ENV = "GYMSERVE_SERVE_CHILD"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

#: What a signal death most likely means, for the one line.
CAUSES = {
    signal.SIGSEGV: "a crash in native code (llama.cpp, torch or another extension)",
    signal.SIGBUS: "a crash in native code (llama.cpp, torch or another extension)",
    signal.SIGILL: "an instruction this CPU lacks: a native library built for another CPU (see the CPU requirements "
    "in docs/getting-started.md)",
    signal.SIGFPE: "a crash in native code (llama.cpp, torch or another extension)",
    signal.SIGABRT: "an abort in native code (a failed assertion in llama.cpp, torch or another extension)",
    signal.SIGKILL: "SIGKILL: the kernel's out-of-memory killer (see `dmesg`) or someone's kill -9",
}


def should_supervise(command: str, argv: Sequence[str] | None) -> bool:
    """Whether ``gymserve COMMAND`` runs under a supervising parent: ``serve`` from a real command
    line (``argv`` None: ``sys.argv``) on POSIX, unless this process is the child already."""
    return command == "serve" and argv is None and os.name == "posix" and not os.environ.get(CHILD_ENV)


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


def describe_death(returncode: int, pid: int) -> str | None:
    """The one line for a child that ended with ``returncode`` (negative: killed by that signal),
    None when it exited by itself (its own messages said why)."""
    if returncode >= 0:
        return None
    sig = signal.Signals(-returncode)
    cause = CAUSES.get(sig, "a signal it did not handle")
    where = (
        "the Python backtrace of every thread (faulthandler) is just above, on stderr"
        if sig not in (signal.SIGKILL,)
        else "no backtrace can be written for SIGKILL"
    )
    return (
        f"gymserve serve: the server process (pid {pid}) died of {sig.name}: {cause}. Calls in flight got no "
        f"answer; {where}. Restart it; if it recurs, see 'Engine faults' in docs/model-servers/local.md"
    )


def supervise(args: Sequence[str]) -> int:
    """Run ``gymserve ARGS...`` (``args``: the command line after the program name) in a child
    process and return its exit status: its own, or ``128 + N`` after printing one line when
    signal N killed it."""
    parent = os.getpid()
    child = subprocess.Popen(
        [sys.executable, "-m", "gymserve.cli", *args],
        env={**os.environ, CHILD_ENV: "1"},
        process_group=0,
        preexec_fn=lambda: _die_with_parent(parent),
    )

    def forward(sig: int, _frame) -> None:
        if child.poll() is None:
            child.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    line = describe_death(returncode, child.pid)
    if line is None:
        return returncode
    print(line, file=sys.stderr, flush=True)
    return 128 - returncode
