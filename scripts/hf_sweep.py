"""The Hugging Face sweep: every family of the installed transformers with a TP plan, compiled with
every strategy on 2 gloo ranks against eager; regenerates the table of docs/models.md.

    nice -n 19 python scripts/hf_sweep.py                 # every family (hf_catalogue.tp_families)
    python scripts/hf_sweep.py gpt_neox minimax           # some families; the others' rows stay
    python scripts/hf_sweep.py --table-only               # rewrite docs/models.md from the results

Each family runs in its own 2 processes, gloo ranks forked from this one once it has imported
and warmed torch, transformers and Inductor (``warm_up``), stopped after a timeout: rank 0 writes
a tiny random checkpoint (``hf_catalogue.save_tiny``), both load it with ``tp_plan="auto"``,
trace it once and compile the graphs fuse-only, with the split forced and with FlashComm
forced (``hf_models.CONFIGS``), each against the same graphs run eagerly. A line per family shows
the progress. Results go to
docs/hf_sweep.json (merged by family, so a partial run updates its rows), and the table between
the sweep markers of docs/models.md is regenerated from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "hf_sweep.json"
MODELS_MD = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- sweep:begin (scripts/hf_sweep.py writes this table) -->", "<!-- sweep:end -->"
AR = "_c10d_functional.all_reduce.default"
TOLERANCE = 1e-4
"""fp32, relative to the output's magnitude: ``weavepass.testing.ATOL[torch.float32]``."""


def _record(r) -> dict:
    return dict(node=r.node, matched=r.matched, lowering=r.lowering, reason=r.reason, kind=r.kind,
                where=getattr(r, "where", ""))


def _summary(runs_per_rank: list[dict]) -> dict:
    """One family's runs on both ranks -> what the table shows, per strategy."""
    out = {}
    for strategy in runs_per_rank[0]:
        ranks = [rank[strategy] for rank in runs_per_rank]
        first = ranks[0]
        entry = dict(rel_diff=max(r.rel_diff for r in ranks), error=next((r.error for r in ranks if r.error), ""),
                     seconds=round(first.seconds, 1), graphs=[])
        decisions = [[[(rec.node, rec.lowering, rec.reason) for rec in g.records] for g in r.graphs] for r in ranks]
        entry["ranks_agree"] = all(d == decisions[0] for d in decisions)
        for graph in first.graphs:
            entry["graphs"].append(dict(
                all_reduces=graph.ops_before[AR], left=graph.ops_after[AR], rewritten=graph.rewritten,
                note=graph.note, records=[_record(r) for r in graph.records]))
        out[strategy] = entry
    return out


def warm_up() -> None:
    """Import and warm what every family's ranks need, once: the ranks are forked from this process
    (``spawn(start_method="fork")``), so each starts with torch, transformers, Dynamo and Inductor
    loaded and initialised instead of paying for it (about 1.5 s of imports per process and 2-3 s of
    Inductor's first compile per rank). No parallel torch op runs here and Inductor compiles in
    this process (``compile_threads=1``): no threads or pools for the forked ranks to inherit."""
    import torch
    import torch._inductor.config
    import transformers

    from weavepass.backend import WeaveBackend
    from weavepass.testing import hf_models

    transformers.logging.set_verbosity_error()
    torch._inductor.config.compile_threads = 1
    backend = WeaveBackend(hf_models.CONFIGS["fuse"])  # (imports the pass's modules: a checkout edited
    with torch.no_grad():                               # during the sweep does not mix into it)
        torch.compile(lambda x: torch.nn.functional.rms_norm(x + 1, (8,)), backend=backend)(torch.ones(2, 8))
    torch._dynamo.reset()


def run_one(family: str, timeout_s: float) -> dict:
    """One family on 2 gloo ranks forked from this process (rank 0 builds the tiny checkpoint; both
    load it, trace it once and compile it with every strategy against eager:
    ``hf_models.run_catalogue_family``), stopped after ``timeout_s``."""
    from weavepass.testing import hf_models, spawn

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            per_rank = spawn(hf_models.run_catalogue_family, 2, "gloo", family, tmp, hf_models.CONFIGS,
                             timeout_s=timeout_s, start_method="fork")
        except TimeoutError:
            return dict(family=family, status="timeout", reason=f"still running after {timeout_s:.0f} s",
                        seconds=round(time.perf_counter() - start, 1))
        except Exception:
            return dict(family=family, status="error", reason=_error_text(traceback.format_exc()),
                        seconds=round(time.perf_counter() - start, 1))
    seconds = round(time.perf_counter() - start, 1)
    if "build_error" in per_rank[0]:
        return dict(family=family, status="build_failed", reason=per_rank[0]["build_error"][:400], seconds=seconds)
    failed = next((rank["model_error"] for rank in per_rank if "model_error" in rank), None)
    if failed is not None:  # (before weave: loading, tracing or running the graphs eagerly)
        return dict(family=family, status="model_failed", reason=_error_text(failed), seconds=seconds)
    phases = {name: round(t, 1) for name, t in per_rank[0]["phases"].items()}
    return dict(family=family, status="ok", strategies=_summary([rank["runs"] for rank in per_rank]),
                phases=phases, seconds=seconds)


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unsupported|Exit|Interrupt)\w*(: |$)")


def _error_text(text: str) -> str:
    """A traceback as what the table shows: its first exception's line and the message lines that
    follow it (the first failed rank's, inside the spawn's error; a peer's broken pipe comes
    later), then the traceback's end."""
    lines = (text.split("\n--- rank ", 1)[1] if "\n--- rank " in text else text).splitlines()
    heads = [i for i, line in enumerate(lines) if _EXCEPTION.match(line)]
    if not heads:
        return text[-1500:]
    first = heads[0]
    end = next((i for i in range(first + 1, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[first:min(end, first + 4)])[:600] + "\n---\n" + text[-1500:]


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _result_cell(entry: dict, strategy: str) -> str:
    if entry["error"]:
        return f"**error**: {_short(_error_text(entry['error']).split(chr(10) + '---')[0], 150)}"
    mark = "equal eager" if entry["rel_diff"] <= TOLERANCE else f"**differs** ({entry['rel_diff']:.1e})"
    if not entry["ranks_agree"]:
        mark += "; **ranks decided differently**"
    notes = [n for g in entry["graphs"] for n in g["note"].split("; ") if n and " is summed with " not in n]
    note = "; ".join(notes)  # (the merged sums are the fuse column's: "sites" vs "fused")
    if strategy == "fuse" or not note:
        return mark
    return f"{mark}: {_short(note, 200)}"


def _row(result: dict) -> str:
    family = result["family"] + (" (again)" if result.get("rerun") else "")
    if result["status"] != "ok":
        reason = result["reason"].split("\n---\n")[0]  # (an error's exception, without its traceback)
        return f"| {family} | | | {result['status']}: {_short(reason, 300)} | | |"
    fuse = result["strategies"]["fuse"]
    sites = sum(g["all_reduces"] for g in fuse["graphs"])
    fused = sum(g["all_reduces"] - g["left"] for g in fuse["graphs"])
    kept = []
    for graph in fuse["graphs"]:
        for r in graph["records"]:
            if not r["lowering"]:
                where = f"`{r['where']}`: " if r["where"] else f"{r['node']}: "
                kept.append(where + _short(r["reason"], 250))
    graphs = f" ({len(fuse['graphs'])} graphs)" if len(fuse["graphs"]) != 1 else ""
    cells = [family, f"{sites}{graphs}", str(fused), "<br>".join(kept) or "",
             _result_cell(fuse, "fuse"), _result_cell(result["strategies"]["split"], "split"),
             _result_cell(result["strategies"]["flashcomm"], "flashcomm")]
    return "| " + " | ".join(cells) + " |"


def write_table(results: dict) -> None:
    """Regenerate the sweep table of docs/models.md from ``results`` (family -> result)."""
    import transformers

    from weavepass.testing.hf_catalogue import tp_families

    missing = sorted(set(tp_families()) - set(results))
    built = [r for r in results.values() if r["status"] == "ok"]
    counts = Counter(r["status"] for r in results.values() if r["status"] != "ok")
    statuses = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "none failed"
    seconds = sum(r.get("seconds", 0) for r in results.values())
    again = (" \"(again)\": the row is from a later run of that family (docs/models.md says why)."
             if any(r.get("rerun") for r in results.values()) else "")
    full = sum(1 for r in built if not r["strategies"]["fuse"]["error"]
               and all(g["left"] == 0 for g in r["strategies"]["fuse"]["graphs"]))
    lines = [
        BEGIN,
        "",
        f"{len(results)} of the {len(results) + len(missing)} families with a TP plan and a causal-LM class "
        f"(transformers {transformers.__version__}) swept; {len(built)} built and run, "
        f"{full} of them with every all_reduce fused; {statuses}. \"sites\": all_reduces in the "
        "fuse-only run's graphs; \"fused\": those replaced by a fused op (a merged sum counts as fused). "
        f"Results: compiled vs the same graph run eagerly, fp32, within {TOLERANCE} of the output's "
        "magnitude. `build_failed`: the tiny checkpoint cannot be built from the config's defaults; "
        "`model_failed`: the model loaded with its own TP plan fails before weave sees it (eager fails "
        f"too). The families' own times add up to {seconds / 60:.0f} min." + again,
        "",
        "| family | sites | fused | kept, and why (fuse-only) | fuse | split forced | FlashComm forced |",
        "|---|---|---|---|---|---|---|",
        *[_row(results[f]) for f in sorted(results)],
        "",
        *([f"Not run in the last sweep ({len(missing)}): " + ", ".join(missing) + "."] if missing else []),
        "",
        END,
    ]
    text = MODELS_MD.read_text()
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + "\n".join(lines) + tail
    else:
        text = text.rstrip("\n") + "\n\n## Every family (generated)\n\n" + "\n".join(lines) + "\n"
    MODELS_MD.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="model types (default: every family with a TP plan)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per family (default 300)")
    parser.add_argument("--table-only", action="store_true", help="only regenerate docs/models.md")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # this checkout's weavepass
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")  # (as scripts/test.sh: compiles faster)

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.table_only:
        from weavepass.testing.hf_catalogue import tp_families

        families = args.families or sorted(tp_families())
        sweep_start = time.perf_counter()
        warm_up()
        print(f"warmed up in {time.perf_counter() - sweep_start:.0f} s", flush=True)
        for i, family in enumerate(families, 1):
            result = results[family] = run_one(family, args.timeout)
            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
            elapsed = time.perf_counter() - sweep_start
            print(f"[{i}/{len(families)}] {family}: {_progress(result)} ({result['seconds']:.0f} s; "
                  f"{elapsed / 60:.1f} min so far)", flush=True)
    write_table(results)
    return 0


def _progress(result: dict) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {_short(result['reason'].split(chr(10) + '---')[0], 160)}"
    parts = []
    for name, entry in result["strategies"].items():
        n = sum(g["all_reduces"] for g in entry["graphs"])
        fused = sum(g["all_reduces"] - g["left"] for g in entry["graphs"])
        diff = entry["rel_diff"]
        ok = "error" if entry["error"] else ("ok" if diff <= TOLERANCE else f"diff {diff:.1e}")
        parts.append(f"{name} {fused}/{n} {ok}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
