"""Run a pytest selection with each test in a process of its own, several at a time.

The simulated-rank GPU tests (``tests/gpu/test_kernel_sim_one_gpu.py``) spend their time compiling
every simulated rank's kernels on the host, one test after another: serially the file does not
finish inside one 10-minute device call (2026-12-04: 4 of 13 tests in 555 s on one H200). The
device machine has 16 CPU cores, so the tests' compiles can run side by side; the GPU work of each
test is small. Timings of such a run mean nothing; it is for correctness only.

Usage: python3 benchmarks/parallel_pytest.py --jobs 6 [--log-dir DIR] FILE... [-k EXPR] [-- PYTEST ARGS...]

Every test's output goes to its own log, printed in full as that test ends; the last line counts
passed, failed, skipped and errors over all tests. Exit status 0 only when no test failed or errored
and at least one test ran.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

OUTCOMES = ("passed", "failed", "skipped", "error", "errors", "xfailed", "xpassed")
_SUMMARY = re.compile(r"(\d+) (" + "|".join(OUTCOMES) + r")\b")


def collect(files: list[str], expr: str | None, extra: list[str]) -> list[str]:
    """The node ids pytest would run for ``files`` (and ``-k expr``), in collection order."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", *files, *extra]
    if expr:
        cmd += ["-k", expr]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode not in (0, 5) or not ids:
        raise SystemExit(f"collection failed or found nothing (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    return ids


def counts(text: str) -> dict[str, int]:
    """The outcome counts of pytest's last summary line in ``text`` ("3 passed, 1 skipped in ...")."""
    found: dict[str, int] = {}
    for line in reversed(text.splitlines()):
        hits = _SUMMARY.findall(line)
        if hits and (" in " in line or line.startswith("=")):
            for number, outcome in hits:
                key = "error" if outcome == "errors" else outcome
                found[key] = found.get(key, 0) + int(number)
            break
    return found


def run_one(node: str, log: Path, extra: list[str]) -> tuple[str, int, dict[str, int]]:
    with log.open("w") as fh:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", node, *extra],
                            stdout=fh, stderr=subprocess.STDOUT, check=False).returncode
    return node, rc, counts(log.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("-k", dest="expr", default=None)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--log-dir", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # further pytest arguments
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    nodes = collect(args.files, args.expr, extra)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="parallel_pytest_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"test_{i:03d}.log" for i in range(len(nodes))]
    print(f"{len(nodes)} tests, {args.jobs} at a time, logs in {log_dir}", flush=True)
    total: dict[str, int] = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, node, log, extra) for node, log in zip(nodes, logs)]
        for future in as_completed(futures):  # each log as its test ends: a run stopped by a limit keeps them
            node, rc, found = future.result()
            log = logs[nodes.index(node)]
            print(f"----- {node} (exit {rc})\n{log.read_text()}", flush=True)
            if not found and rc != 0:
                found = {"error": 1}  # ended without a summary (killed, crashed)
            for key, value in found.items():
                total[key] = total.get(key, 0) + value
    print("parallel_pytest total: " + ", ".join(f"{v} {k}" for k, v in sorted(total.items())), flush=True)
    bad = total.get("failed", 0) + total.get("error", 0)
    return 0 if bad == 0 and total.get("passed", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
