"""Prints scripts/gpu_check.sh's closing table from its TSV results; standard library only.

  python3 scripts/gpu_check_report.py RESULTS.tsv [--kernel-log LOG]

RESULTS.tsv: one row per line, `step<TAB>result<TAB>key<TAB>detail`, result one of PASS, FAIL,
SKIP, INFO; a FAIL/SKIP row without a key shows (the start of) its detail instead. With --kernel-log, the row named "kernels" gets its key number from the markdown
table printed by scripts/gpu_check_kernels.py (cases ok, worst error, one timing).
Exit status 1 if any row is FAIL (or there are no rows), else 0.
"""

from __future__ import annotations

import argparse
import re
import sys


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def kernel_summary(path: str) -> str:
  """'ok/total ok, worst err E; <largest shape, bf16 if any, smallest fraction>: K us in jit'."""
  try:
    with open(path, errors="replace") as f:
      lines = f.read().splitlines()
  except OSError as e:
    return f"no log ({e.strerror})"
  header = None
  rows = []
  for line in lines:
    if line.startswith("| shape |"):
      header = _cells(line)
      continue
    if header and line.startswith("|") and not line.startswith("| ---"):
      cells = _cells(line)
      if len(cells) == len(header):
        rows.append(dict(zip(header, cells)))
  if not rows:  # The script died before its table: count the progress lines instead.
    prog = [ln for ln in lines if re.search(r": (ok|FAIL.*|skip.*)$", ln)]
    if not prog:
      return "no case ran"
    ok = sum(ln.endswith(": ok") for ln in prog)
    return f"{ok}/{len(prog)} cases ok before it stopped (no table)"
  ok = sum(r["status"] == "ok" for r in rows)
  errs = [float(r["max err"]) for r in rows if r["max err"] not in ("-", "")]
  worst = f", worst err {max(errs):.1e}" if errs else ""

  def d_of(r):
    m = re.search(r"d=(\d+), n_hot=(\d+)", r["shape"])
    return int(m.group(1)) * int(m.group(2)) if m else 0

  def frac(r):
    try:
      return float(r["active %"].rstrip("%"))
    except ValueError:
      return 1e9

  timed = [r for r in rows if r["kernel us (in jit)"] not in ("-", "")]
  pick = ""
  if timed:
    biggest = max(d_of(r) for r in timed)
    cand = [r for r in timed if d_of(r) == biggest]
    cand = [r for r in cand if r["dtype"] == "bfloat16"] or cand
    r = min(cand, key=frac)
    pick = (f"; {r['shape'].split(' ')[0]} {r['dtype']} {r['active %']}: kernel "
            f"{r['kernel us (in jit)']} us in jit vs dense {r['dense us (in jit)']} us")
  return f"{ok}/{len(rows)} ok{worst}{pick}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("results")
  p.add_argument("--kernel-log", default=None)
  args = p.parse_args(argv)
  rows = []
  try:
    with open(args.results, errors="replace") as f:
      for line in f:
        parts = line.rstrip("\n").split("\t")
        if len(parts) >= 2 and parts[0]:
          rows.append((parts + ["", ""])[:4])
  except OSError:
    pass
  for row in rows:
    if row[0] == "kernels" and args.kernel_log:
      summary = kernel_summary(args.kernel_log)
      row[2] = f"{summary}; {row[2]}" if row[2] else summary
  if not rows:
    rows.append(["(no results)", "FAIL", "", ""])
  width = max(len(r[0]) for r in rows)
  print()
  print(f"| {'step'.ljust(width)} | result | key number |")
  print(f"| {'-' * width} | ------ | ---------- |")
  for step, result, key, detail in rows:  # details stay in the log above, but for errors
    if not key and result in ("FAIL", "SKIP") and detail:
      key = detail if len(detail) <= 90 else detail[:87] + "..."
    print(f"| {step.ljust(width)} | {result.ljust(6)} | {key} |")
  failed = sum(r[1] == "FAIL" for r in rows)
  print(f"| {'overall'.ljust(width)} | {'FAIL' if failed else 'PASS':6} | "
        f"{failed} of {len(rows)} rows failed |")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
