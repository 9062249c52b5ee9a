"""The Hugging Face sweep: every family of the installed transformers with a TP plan, compiled with
every strategy on 2 gloo ranks against eager; regenerates the table of docs/models.md.

    nice -n 19 python scripts/hf_sweep.py                 # every family (hf_catalogue.tp_families)
    python scripts/hf_sweep.py gpt_neox minimax           # some families; the others' rows stay
    python scripts/hf_sweep.py --table-only               # rewrite docs/models.md from the results

Each family runs in its own process (``--one``) with a timeout: it writes a tiny random checkpoint
(``hf_catalogue.save_tiny``), spawns 2 gloo ranks that load it with ``tp_plan="auto"``, trace it
once and compile the graphs fuse-only, with the token split forced and with FlashComm forced
(``hf_models.CONFIGS``), each against the same graphs run eagerly. Results go to
docs/hf_sweep.json (merged by family, so a partial run updates its rows), and the table between
the sweep markers of docs/models.md is regenerated from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
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


def run_one(family: str) -> dict:
    """Build, load, compile and compare one family (in this process and 2 spawned ranks)."""
    import torch  # noqa: F401

    from weavepass.testing import hf_catalogue, hf_models, spawn

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            hf_catalogue.save_tiny(family, tmp)
        except Exception as error:
            return dict(family=family, status="build_failed", reason=f"{type(error).__name__}: {error}"[:400],
                        seconds=round(time.perf_counter() - start, 1))
        try:
            per_rank = spawn(hf_models.run_families, 2, "gloo", {family: tmp}, hf_models.CONFIGS, timeout_s=1200)
        except Exception:
            return dict(family=family, status="error", reason=traceback.format_exc()[-1500:],
                        seconds=round(time.perf_counter() - start, 1))
    strategies = _summary([rank[family] for rank in per_rank])
    return dict(family=family, status="ok", strategies=strategies, seconds=round(time.perf_counter() - start, 1))


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _result_cell(entry: dict, strategy: str) -> str:
    if entry["error"]:
        return f"**error**: {_short(entry['error'].strip().splitlines()[-1], 150)}"
    mark = "equal eager" if entry["rel_diff"] <= TOLERANCE else f"**differs** ({entry['rel_diff']:.1e})"
    if not entry["ranks_agree"]:
        mark += "; **ranks decided differently**"
    notes = [n for g in entry["graphs"] for n in g["note"].split("; ") if n and " is summed with " not in n]
    note = "; ".join(notes)  # (the merged sums are the fuse column's: "sites" vs "fused")
    if strategy == "fuse" or not note:
        return mark
    return f"{mark}: {_short(note, 200)}"


def _row(result: dict) -> str:
    family = result["family"]
    if result["status"] != "ok":
        return f"| {family} | | | {result['status']}: {_short(result['reason'], 300)} | | |"
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
    full = sum(1 for r in built if not r["strategies"]["fuse"]["error"]
               and all(g["left"] == 0 for g in r["strategies"]["fuse"]["graphs"]))
    lines = [
        BEGIN,
        "",
        f"{len(results)} of the {len(results) + len(missing)} families with a TP plan and a causal-LM class "
        f"(transformers {transformers.__version__}) swept; {len(built)} built and run, "
        f"{full} of them with every all_reduce fused. \"sites\": all_reduces in the fuse-only run's "
        "graphs; \"fused\": those replaced by a fused op (a merged sum counts as fused). Results: "
        f"compiled vs the same graph run eagerly, fp32, within {TOLERANCE} of the output's magnitude.",
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
    parser.add_argument("--one", help="run one family in this process and print its result as JSON")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per family (default 600)")
    parser.add_argument("--table-only", action="store_true", help="only regenerate docs/models.md")
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one)))
        return 0

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.table_only:
        from weavepass.testing.hf_catalogue import tp_families

        families = args.families or sorted(tp_families())
        env = dict(os.environ, PYTHONPATH=str(ROOT),
                   TORCHINDUCTOR_VEC_ISA_OK=os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "0"))
        for i, family in enumerate(families, 1):
            start = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, __file__, "--one", family], capture_output=True, text=True,
                                      timeout=args.timeout, env=env, cwd=ROOT)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                result = json.loads(line[7:]) if line else dict(
                    family=family, status="error", reason=(proc.stderr or proc.stdout)[-1500:])
            except subprocess.TimeoutExpired:
                result = dict(family=family, status="timeout", reason=f"still running after {args.timeout:.0f} s")
            results[family] = result
            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
            print(f"[{i}/{len(families)}] {family}: {_progress(result)} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    write_table(results)
    return 0


def _progress(result: dict) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {_short(result['reason'], 120)}"
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
