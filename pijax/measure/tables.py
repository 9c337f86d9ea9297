"""Markdown tables and number formats of the benches' reports (`pijax.bench_ops` and the rest)."""

from __future__ import annotations

from typing import Iterable, Sequence

from pijax.measure.active_sets import ID_SETS
from pijax.measure.matvec import DownPassRow, MatvecRow
from pijax.measure.sparse_op import OP_PALLAS, PALLAS_LOOPS, Row


def markdown_table(header: Sequence[str], align: str,
                   rows: Iterable[Sequence[str]]) -> list[str]:
  """The lines of a markdown table: `| a | b |`, the separator (align: one letter a column, "l"
  for `---`, "r" for the right-aligned `---:`), then one line per row of cell strings."""
  if len(align) != len(header):
    raise ValueError(f"align {align!r} must have one letter per column of {list(header)}")
  seps = ["---:" if a == "r" else "---" for a in align]
  return ["| " + " | ".join(cells) + " |" for cells in (header, seps, *rows)]


def pct(frac: float) -> str:
  """0.9 -> "90%" (4 significant digits)."""
  return f"{frac * 100:.4g}%"


def fmt_time(t: float) -> str:
  """Seconds -> "123.4 us" below 10 ms, else "12.34 ms"."""
  return f"{t * 1e6:.1f} us" if t < 1e-2 else f"{t * 1e3:.2f} ms"


MD_COLUMNS = ("op", "format", "shape", "hidden", "intermediate", "sparsity", "active neurons",
              "time/call", "GB/s", "vs dense")
MD_HEADER = "| " + " | ".join(MD_COLUMNS) + " |"


def format_markdown(rows: list[Row]) -> str:
  """The sparse op table: one line per row; vs dense as a percentage ("-"
  without a 0% row)."""
  return "\n".join(markdown_table(MD_COLUMNS, "lllrrrrrrr", (
      [r.op, r.format, r.shape, str(r.hidden), str(r.intermediate), pct(r.sparsity),
       f"{r.active_neurons:.0f}", fmt_time(r.time_s), f"{r.gb_s:.2f}",
       "-" if r.vs_dense is None else f"{r.vs_dense:.0%}"] for r in rows)))


def format_notes(rows: list[Row], opts, cold_bytes: float) -> str:
  """Lines under the sparse op table (opts: `pijax.bench_ops.Options`): the active-set law,
  the timing rule, copies and flushes per layer."""
  lines = [
      f"b=1, swiglu. Active sets: neuron i active with p_i = min(1, c*(i+1)^-{opts.alpha:g}), c "
      f"set so E[active] = (1 - sparsity) * n; {ID_SETS} sets per row from "
      f"default_rng([{opts.seed}, n, round(sparsity*1e4)]).",
      f"time/call: host = median of every timed Python call ({opts.threads} numba threads); "
      f"pallas = median of {PALLAS_LOOPS} jitted loops / calls. GB/s = weight bytes read / "
      f"time. Cold target {cold_bytes / 1e6:.0f} MB between two reads of one layer copy.",
  ]
  if OP_PALLAS not in opts.ops:
    lines.append(f"pallas: not run (jax backend {opts.backend or 'not checked'}; it needs gpu).")
  seen = set()
  for r in rows:
    key = (r.op, r.format, r.shape)
    if key in seen:
      continue
    seen.add(key)
    same = [s for s in rows if (s.op, s.format, s.shape) == key]
    flush = ", ".join(f"{pct(s.sparsity)} {s.flush_mb:.0f}" for s in same if s.flush_mb > 0)
    warm = [pct(s.sparsity) for s in same if not s.from_dram]
    line = f"{r.op} {r.format} {r.shape}: {r.copies} layer copies"
    if flush:
      line += f"; untimed flush MB/call: {flush}"
    if warm:
      line += f"; reuse distance under the cold target at {', '.join(warm)} (may hit cache)"
    lines.append(line)
  return "\n".join(lines)


def _rate_cells(r: MatvecRow | DownPassRow) -> list[str]:
  """time/call, G weights/s, GB/s (" (cache)" when the copies stayed under the cold target) and
  the share of the read bandwidth ("-" when not measured) of a matvec or down-pass row."""
  return [fmt_time(r.time_s), f"{r.g_weights_s:.1f}",
          f"{r.gb_s:.1f}" + ("" if r.from_dram else " (cache)"),
          "-" if r.vs_bandwidth is None else f"{r.vs_bandwidth:.0%}"]


def format_matvec(rows: list[MatvecRow]) -> str:
  """The dense matvec table."""
  return "\n".join(markdown_table(
      ("shape", "matrix", "rows x cols", "format", "dot", "time/call", "G weights/s", "GB/s",
       "vs read bandwidth"), "lllllrrrr",
      ([r.shape, r.matrix, f"{r.rows} x {r.cols}", r.format, r.dot, *_rate_cells(r)]
       for r in rows)))


def format_down_pass(rows: list[DownPassRow]) -> str:
  """The sparse down-pass table, with the dense Q4_1 matvec's time."""
  return "\n".join(markdown_table(
      ("shape", "F x D", "format", "dot", "active", "time/call", "G weights/s", "GB/s",
       "vs read bandwidth", "dense Q4_1 matvec", "speedup"), "llllrrrrrrr",
      ([r.shape, f"{r.rows} x {r.cols}", r.format, r.dot, f"{r.active:.0%}", *_rate_cells(r),
        fmt_time(r.dense_time_s), f"{r.vs_dense:.2f}x"] for r in rows)))
