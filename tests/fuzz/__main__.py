"""`python -m tests.fuzz`: run the differential fuzzer over seeds, for a time or a count; replay and shrink one.

    python -m tests.fuzz --minutes 30             # seeds from --start on, for 30 minutes
    python -m tests.fuzz --seeds 0-199            # these seeds
    python -m tests.fuzz --seed 17 --only 2,5     # replay one case (the command a failure prints)

A failing seed is shrunk to the fewest requests that still fail, and printed with the command that replays it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tqdm import tqdm

from .runner import Models, Reference, replay_command, run_workload, shrink
from .workload import VARIANTS, generate


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, help="one seed (with --only: a shrunk case)")
    ap.add_argument("--only", help="comma-separated request indices of the seed's workload to keep")
    ap.add_argument("--seeds", help="seeds to run, e.g. 0-99,120")
    ap.add_argument("--minutes", type=float, help="run consecutive seeds from --start for this long")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--variant", choices=VARIANTS, help="run every seed on this model (default: drawn per seed)")
    ap.add_argument(
        "--outputs-only",
        action="store_true",
        help="skip the per-step state-copy and pin-release checks: find defects by their outputs alone",
    )
    ap.add_argument("--no-shrink", action="store_true", help="report a failing seed without shrinking it")
    ap.add_argument("--json", metavar="PATH", help="write the run's summary (seeds, requests, steps, failures) here")
    args = ap.parse_args(argv)

    models, reference = Models(), Reference()
    summary = {"seeds": 0, "requests": 0, "steps": 0, "divergences": 0, "failures": []}
    try:
        if args.seed is not None:
            only = frozenset(map(int, args.only.split(","))) if args.only else None
            workload = generate(args.seed, args.variant).keep(only)
            print(workload.describe())
            failures = run_workload(workload, models, reference, not args.outputs_only)
            for f in failures:
                print(f)
            print("FAILED" if failures else "ok")
            return 1 if failures else 0
        deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
        seeds = _seeds(args.seeds) if args.seeds else None
        seed = args.start
        bar = tqdm(total=len(seeds) if seeds else None, unit="seed", dynamic_ncols=True)
        while True:
            if seeds is not None:
                if not seeds:
                    break
                seed = seeds.pop(0)
            elif deadline is None or time.monotonic() > deadline:
                break
            workload = generate(seed, args.variant)
            from .runner import Run

            run = Run(workload, models, reference, not args.outputs_only)
            failures = run.run()
            summary["seeds"] += 1
            summary["requests"] += len(workload.requests)
            summary["steps"] += run.steps
            bar.update(1)
            if failures:
                summary["divergences"] += sum(f.kind == "divergence" for f in failures)
                only = None
                if not args.no_shrink:
                    bar.write(f"seed {seed} failed ({failures[0]}); shrinking ...")
                    first = failures
                    only, failures = shrink(workload, models, reference, bar.write, not args.outputs_only)
                    if not failures:  # it did not fail again: report it as it was, unshrunk
                        only, failures = None, [f for f in first]
                        bar.write(f"seed {seed} did not fail when run again: its failure depends on timing")
                command = replay_command(seed, args.variant, only)
                bar.write(f"FAILED {workload.describe()}\n  {failures[0]}\n  replay: {command}")
                summary["failures"].append({"seed": seed, "failure": str(failures[0]), "replay": command})
            seed += 1
        bar.close()
    finally:
        models.close()
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
