"""devtools/kernel_selftest/ncu_stalls.py: Nsight Compute SASS-page CSV -> stall breakdown."""
import csv

import pytest

from tests._scripts import load_script

_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
           "Warp Stall Sampling (Not-issued Samples)", "stall_barrier", "stall_long_sb",
           "stall_short_sb", "stall_barrier (Not Issued)"]


@pytest.fixture(scope="module")
def ncu_stalls():
  return load_script("devtools/kernel_selftest/ncu_stalls.py")


def _write(path, kernels):
  with open(path, "w", newline="") as f:
    w = csv.writer(f, quoting=csv.QUOTE_ALL)
    for name, rows in kernels:
      w.writerow(["Kernel Name", name])
      w.writerow(_HEADER)
      for addr, src, barrier, long_sb, short_sb in rows:
        total = barrier + long_sb + short_sb
        w.writerow([addr, src, total, total, barrier, long_sb, short_sb, barrier])


def test_roles_split_at_the_consumers_register_resize(ncu_stalls, tmp_path, capsys):
  main = "kernel_cutlass_kernel_jaxflashkernelsbwd_sm90FlashAttentionBackwardSm90_object_at__t0"
  post = ("kernel_cutlass_kernel_jaxflashkernelsbwd_postprocess"
          "FlashAttentionBackwardPostprocess_object_at__t1")
  path = tmp_path / "sass.csv"
  _write(path, [
      (main, [("0x10", "BRA 0x40", 0, 30, 0),
              ("0x20", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 0, 0, 0),
              ("0x30", "@!P0 FFMA R1, R2, R3, R4", 0, 0, 60),
              ("0x40", "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", 20, 0, 0)]),
      (post, [("0x10", "LDG.E.128 R4, desc[UR4][R2.64]", 0, 10, 0)]),
  ])
  kernels = ncu_stalls.read_kernels(str(path))
  assert [ncu_stalls.short_name(n) for n, _, _ in kernels] == [
      "FlashAttentionBackwardSm90", "FlashAttentionBackwardPostprocess"]
  header, rows = kernels[0][1], kernels[0][2]
  roles = ncu_stalls.split_roles(header, rows)
  assert [len(r) for r in roles.values()] == [1, 3]
  assert list(ncu_stalls.split_roles(*kernels[1][1:])) == ["kernel"]
  assert ncu_stalls.opcode("@!P0 FFMA R1, R2, R3, R4") == "FFMA"
  assert ncu_stalls.main([str(path), "--top", "2"]) == 0
  out = capsys.readouterr().out.splitlines()
  # Consumers: 80 samples, short_sb 60 (all at FFMA), barrier 20; the predicate is dropped.
  i = out.index("FlashAttentionBackwardSm90: consumers")
  assert out[i + 1].startswith("  80 samples: short_sb 75.0 %, barrier 25.0 %")
  assert out[i + 2].split()[:2] == ["FFMA", "75.0"]
  assert "FlashAttentionBackwardPostprocess: kernel" in out


def test_a_file_without_a_sass_table_is_refused(ncu_stalls, tmp_path):
  path = tmp_path / "empty.csv"
  path.write_text('"==PROF== no kernels were profiled"\n')
  with pytest.raises(SystemExit, match="no SASS source table"):
    ncu_stalls.read_kernels(str(path))
