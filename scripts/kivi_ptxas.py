"""Compile the KIVI decode kernel's CUDA rendering with nvcc as MLX's cuda_kernel wraps it, and
print what ptxas reports (registers per thread, spills, shared memory) and the occupancy that
follows on an H200 (65536 registers and 228 KiB of shared memory per SM, 64 warps at most).

MLX JIT-compiles with NVRTC on the GPU host; nvcc's ptxas is the same back end, so the register
count is the one the GPU sees (checked against Nsight Compute's 122 for v2, third H200 window).

    python scripts/kivi_ptxas.py --version v3 --bits 4 --ratio 4 --warps 8 [--extra PF=1]
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vqpipe.kivi import decode_kernel  # noqa: E402

_PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };
"""
_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


def source(version, dtype, bits, g, d, r, warps, extra=(), minblocks=0):
    """The translation unit MLX would build (mlx/backend/cuda/custom_kernel.cpp, build_kernel)."""
    name, header, body = decode_kernel.render("cuda", version, "small", warps, minblocks)
    ins = {"kp": "__half", "vp": "__half", "kc": "unsigned int", "vc": "unsigned int", "meta": "float", "scratch": "float",
           "counters": "unsigned int"}
    shaped = {"kc", "vc", "rk", "scratch"}
    args = []
    for n in decode_kernel.INPUTS:
        args.append(f"const {ins.get(n, _TYPES[dtype])}* {n}")
        if n in shaped or f"{n}_shape" in body:
            args.append(f"const __grid_constant__ Shape {n}_shape")
    args.append(f"{_TYPES[dtype]}* out")
    consts = [f"using T = {_TYPES[dtype]};", f"constexpr int BITS = {bits};", f"constexpr int G = {g};", f"constexpr int D = {d};",
              f"constexpr int R = {r};", f"constexpr int NW = {warps};", "constexpr int SCALE_BITS = 1035098829;"]
    consts += [f"constexpr int {k} = {v};" for k, v in extra]
    return (_PRELUDE + header + "namespace mlx::core::cu {\n__global__ void " + name + "(\n    " + ",\n    ".join(args) + ") {\n  "
            + "\n  ".join(consts) + "\n" + body + "\n}\n}\n")


def ptxas(src, arch="sm_90", nvdisasm=None):
    with tempfile.TemporaryDirectory() as t:
        (Path(t) / "k.cu").write_text(src)
        r = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v", "k.cu", "-o", "k.cubin"], cwd=t,
                           capture_output=True, text=True)
        sass = subprocess.run([nvdisasm, "-c", "k.cubin"], cwd=t, capture_output=True, text=True).stdout if nvdisasm and not r.returncode else ""
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spill = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", r.stderr)] or [0, 0]
    smem = re.search(r"(\d+) bytes smem", r.stderr)
    out = {"registers": regs, "spill_stores": spill[0], "spill_loads": spill[1], "smem": int(smem.group(1)) if smem else 0}
    if sass:
        out.update(sass_blocks(sass))
    return out


def sass_blocks(sass):
    """Instruction count, the largest basic blocks with arithmetic (instructions, FFMAs), and the
    quantized-code round trips a chunk waits on in line: blocks whose FFMAs sit with plain 32-bit
    global loads (LDG.E: code words and parameter pairs; the residual's are .U16, the final merge's
    .STRONG.GPU). v2's values loop is one such block per unrolled token-word, each load followed by
    the arithmetic that needs it."""
    blocks, label = {}, "entry"
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            blocks.setdefault(label, []).append(m.group(1))
        elif re.match(r"\.L_x_\d+:", line.strip()):
            label = line.strip()
    math = [b for b in blocks.values() if any("FFMA" in x for x in b)]
    code_ld = lambda b: sum(bool(re.search(r"\bLDG\.E\s", x)) for x in b)  # noqa: E731
    return {"sass_instructions": sum(len(b) for b in blocks.values()),
            "largest_math_blocks": sorted(((len(b), sum("FFMA" in x for x in b)) for b in math), reverse=True)[:3],
            "in_line_load_blocks": sum(code_ld(b) > 0 for b in math)}


def blocks_per_sm(regs, smem, warps):
    by_regs = 65536 // (-(-regs // 8) * 8 * 32 * warps)
    by_smem = (228 * 1024) // max(1, smem + 1024)
    return min(by_regs, by_smem, 64 // warps, 32)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--version", default="v3")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--extra", nargs="*", default=[], help="more constants NAME=VALUE (v3: PF=0 or 1)")
    p.add_argument("--minblocks", type=int, nargs="+", default=[0], help="__launch_bounds__ blocks per SM (0: none)")
    p.add_argument("--print", action="store_true", help="print the source")
    p.add_argument("--nvdisasm", help="path of nvdisasm: also count the SASS (pip package nvidia-cuda-nvdisasm)")
    a = p.parse_args(argv)
    extra = [tuple(x.split("=")) for x in a.extra]
    for bits in a.bits:
        for w, mb in ((w, mb) for w in a.warps for mb in a.minblocks):
            src = source(a.version, a.dtype, bits, a.group_size, a.head_dim, a.ratio, w, extra, mb)
            if a.print:
                print(src)
            rep = ptxas(src, nvdisasm=a.nvdisasm)
            nb = blocks_per_sm(rep["registers"], rep["smem"], w)
            line = (f"{a.version} {a.dtype} bits {bits} D {a.head_dim} R {a.ratio} warps {w} minblocks {mb} {' '.join(a.extra)}: {rep['registers']} registers, "
                    f"spills {rep['spill_stores']}/{rep['spill_loads']} B, smem {rep['smem']} B -> {nb} blocks/SM, {nb * w} warps/SM")
            if "sass_instructions" in rep:
                line += (f"; SASS {rep['sass_instructions']}, largest blocks (instructions, FFMA) {rep['largest_math_blocks']}, "
                         f"{rep['in_line_load_blocks']} blocks with code loads among their FFMAs")
            print(line)


if __name__ == "__main__":
    main()
