"""Extract the cubin embedded in each exported object (ELF symbol *kernels_binary*), disassemble
it with cuobjdump and count HGMMA / LDL / STL / registers / spill info per kernel.

usage: inspect_sass.py BUILD_DIR  (the fa4_*.o objects there; writes BUILD_DIR/sass/<name>.cubin,
.sass, and summary.json)
"""

import json
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from jaxflash.kernels.compile import extract_cubin, find_tool  # noqa: E402

CUOBJDUMP = find_tool("cuobjdump")


def main():
  build = pathlib.Path(sys.argv[1])
  out = build / "sass"
  out.mkdir(exist_ok=True)
  summary = {}
  for obj in sorted(build.glob("fa4_*.o")):
    cub = out / (obj.stem + ".cubin")
    cub.write_bytes(extract_cubin(obj))
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cub)], check=True, capture_output=True,
                          text=True).stdout
    (out / (obj.stem + ".sass")).write_text(sass)
    res = subprocess.run([CUOBJDUMP, "-res-usage", str(cub)], check=True, capture_output=True,
                         text=True).stdout
    (out / (obj.stem + ".res")).write_text(res)
    lines = [l for l in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", l)]
    count = lambda pat: sum(1 for l in lines if re.search(pat, l))
    regs = [int(x) for x in re.findall(r"REG:(\d+)", res)]
    stack = [int(x) for x in re.findall(r"STACK:(\d+)", res)]
    lmem = [int(x) for x in re.findall(r"LOCAL:(\d+)", res)]
    summary[obj.stem] = {
        "cubin_bytes": cub.stat().st_size,
        "sm": sorted(set(re.findall(r"code for (sm_\w+)", sass))),
        "functions": re.findall(r"Function : (\S+)", sass),
        "instructions": len(lines),
        "HGMMA": count(r"\bHGMMA\."),
        "UTMALDG": count(r"\bUTMALDG"),
        "UTMASTG": count(r"\bUTMASTG"),
        "UBLKRED": count(r"\bUBLKRED"),
        "LDL": count(r"\bLDL\b|\bLDL\."),
        "STL": count(r"\bSTL\b|\bSTL\."),
        "USETMAXREG": sorted(set(re.findall(r"USETMAXREG\.\S+ \S+", sass))),
        "REG": regs, "STACK": stack, "LOCAL": lmem,
    }
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  main()
