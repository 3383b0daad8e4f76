"""Warp-stall breakdown of kernels from Nsight Compute's SASS page (devtools, not shipped).

Input: the CSV of `ncu --import REPORT --page source --print-source sass --csv` (each kernel
of the report has its table). Prints, per kernel and warp role, the share of each stall reason
in the sampled warp states and the instructions holding most samples with their top reasons.
The roles are told apart by SASS address: a warp-specialised kernel (bwd_sm90, fwd_sm90) lays
out the producer branch first and the consumers from their `USETMAXREG.TRY_ALLOC` on; a kernel
without it is one role.

  python3 devtools/kernel_selftest/ncu_stalls.py out/main_sass.csv [--top 14]
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

_SAMPLES = "Warp Stall Sampling (All Samples)"
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def read_kernels(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
  """(kernel name, header, instruction rows) per kernel; each table follows a "Kernel Name"
  line."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  kernels = []
  for i, r in enumerate(rows):
    if r and r[0] == "Kernel Name" and i + 1 < len(rows) and _SAMPLES in rows[i + 1]:
      header = rows[i + 1]
      end = next((j for j in range(i + 2, len(rows)) if rows[j] and rows[j][0] == "Kernel Name"),
                 len(rows))
      kernels.append((r[1] if len(r) > 1 else "?", header,
                      [x for x in rows[i + 2:end] if len(x) >= len(header)]))
  if not kernels:
    raise SystemExit(f"{path}: no SASS source table with a '{_SAMPLES}' column")
  return kernels


def short_name(name: str) -> str:
  """kernel_cutlass_kernel_jaxflashkernelsbwd_sm90FlashAttentionBackwardSm90_object_at_... ->
  FlashAttentionBackwardSm90 (the class before "_object"; FA-4's kernels are named alike)."""
  found = re.search(r"([A-Z][A-Za-z0-9]*)_object", name)
  return found.group(1) if found else name[:60]


def opcode(source: str) -> str:
  """'@!P0 HGMMA.64x80x16.F32.BF16 R24, ...' -> 'HGMMA.64x80x16.F32.BF16'."""
  return _PREDICATE.sub("", source.strip()).split(" ")[0]


def split_roles(header: list[str], rows: list[list[str]]) -> dict[str, list[list[str]]]:
  src = header.index("Source")
  first = next((i for i, r in enumerate(rows) if "USETMAXREG.TRY_ALLOC" in r[src]), None)
  if first is None:
    return {"kernel": rows}
  return {"producer / writer": rows[:first], "consumers": rows[first:]}


def summarize(header: list[str], rows: list[list[str]], top: int) -> list[str]:
  col = {h: i for i, h in enumerate(header)}
  reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  total = collections.Counter()
  by_op = collections.defaultdict(collections.Counter)
  samples = 0
  for r in rows:
    samples += int(r[col[_SAMPLES]] or 0)
    op = opcode(r[col["Source"]])
    for name in reasons:
      v = int(r[col[name]] or 0)
      total[name] += v
      by_op[op][name] += v
  if samples == 0:
    return ["  no samples"]
  lines = [f"  {samples} samples: " + ", ".join(
      f"{name[6:]} {100 * v / samples:.1f} %" for name, v in total.most_common(9))]
  per_op = collections.Counter({op: sum(c.values()) for op, c in by_op.items()})
  for op, v in per_op.most_common(top):
    why = ", ".join(f"{k[6:]} {100 * x / v:.0f} %" for k, x in by_op[op].most_common(3) if v)
    lines.append(f"    {op:30s} {100 * v / samples:5.1f} %  ({why})")
  return lines


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("csv")
  p.add_argument("--top", type=int, default=14, help="instructions listed per role")
  args = p.parse_args(argv)
  for name, header, rows in read_kernels(args.csv):
    for role, part in split_roles(header, rows).items():
      print(f"{short_name(name)}: {role}")
      print("\n".join(summarize(header, part, args.top)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
