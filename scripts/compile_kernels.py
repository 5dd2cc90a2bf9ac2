#!/usr/bin/env python3
"""Compile Strata's CUDA kernel sources with ``nvcc`` as MLX's CUDA backend would wrap them, on a
machine with no GPU: syntax, and each instantiation's registers and spills (``ptxas -v``).

MLX (``mlx/backend/cuda/custom_kernel.cpp``, ``build_kernel``) writes a ``__global__`` function
whose parameters are the inputs (``const T* name``, plus ``name_shape`` where the source uses it),
then the outputs, and whose body starts with the template arguments as ``constexpr`` values and
``using`` types. This script writes the same around ``executor.cuda_qmv``'s sources, with a
stand-in for MLX's ``Shape`` (its device header is not installed off CUDA), and compiles each
store for ``--arch`` (sm_90 by default: the lent H100/H200).

usage: python scripts/compile_kernels.py [--arch sm_90] [--stores plain,swiglu] [--keep DIR]
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from strata.executor import cuda_qmv

_PRELUDE = """
#include <cstdint>
namespace mlx::core::cu {
struct Shape { int32_t d[8]; __device__ int32_t operator[](int i) const { return d[i]; } };
}
"""

_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "int32": "int32_t"}


def _input_type(name: str, dtype: str) -> str:
    if name.startswith("w") and len(name) <= 2 or name in ("wg", "wu"):
        return "uint32_t"
    if name == "positions":
        return "int32_t"
    if name in ("freqs", "rope"):
        return "float"
    return _TYPES[dtype]


def qmv_source(
    store: str, dtype: str, bits: int, group: int, rope: bool = False, u: int = 4, ks: int = 1
) -> str:
    """The whole translation unit MLX would compile for one ``cuda_qmv`` instantiation (``u``
    slabs in flight, ``ks`` warps splitting K: ``cuda_qmv.k_split``)."""
    header, body = cuda_qmv.source(store)
    params = []
    for name in cuda_qmv.INPUTS[store]:
        params.append(f"const {_input_type(name, dtype)}* {name}")
        if re.search(rf"\b{name}_shape\b", body):
            params.append(f"const __grid_constant__ Shape {name}_shape")
    params += [f"{_TYPES[dtype]}* {name}" for name in cuda_qmv.OUTPUTS[store]]
    consts = [
        f"using T = {_TYPES[dtype]};",
        f"constexpr int GS = {group};",
        f"constexpr int BITS = {bits};",
        f"constexpr int R = {cuda_qmv.ROWS_PER_WARP};",
        f"constexpr int WPB = {max(cuda_qmv.WARPS_PER_BLOCK, ks)};",  # a multiple of KS
        f"constexpr int U = {u};",
        f"constexpr int KS = {ks};",
    ]
    if rope:
        consts += [
            "constexpr int HD = 128;",
            "constexpr int RD = 128;",
            "constexpr bool FREQS = false;",
        ]
    return (
        _PRELUDE
        + header
        + "namespace mlx::core::cu {\n"
        + f"__global__ void strata_qmv_{store}_{dtype}_{bits}_{group}(\n    "
        + ",\n    ".join(params)
        + ") {\n"
        + "\n".join(consts)
        + "\n"
        + body
        + "}\n}\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--stores", default=",".join(cuda_qmv.INPUTS))
    ap.add_argument("--keep", type=Path, help="write the .cu files here")
    ap.add_argument("--splits", default="4:1,2:2,1:4", help="U:KS pairs (cuda_qmv.k_split)")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("compile_kernels: nvcc is not on PATH; install the CUDA toolkit", file=sys.stderr)
        return 2
    stores = args.stores.split(",")
    if unknown := [st for st in stores if st not in cuda_qmv.INPUTS]:
        known = ", ".join(cuda_qmv.INPUTS)
        ap.error(f"--stores: unknown {', '.join(unknown)}; choose from {known}")
    try:
        splits = [tuple(int(v) for v in p.split(":")) for p in args.splits.split(",")]
    except ValueError:
        splits = []
    if not splits or any(len(p) != 2 or min(p) < 1 for p in splits):
        ap.error("--splits: pairs U:KS of positive integers, e.g. 4:1,2:2")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for store in stores:
            for dtype in ("float16", "bfloat16"):
                for bits, (u, ks) in itertools.product(cuda_qmv.BITS, splits):
                    cu = out / f"qmv_{store}_{dtype}_{bits}_u{u}_ks{ks}.cu"
                    rope = store == "split3_rope"
                    cu.write_text(qmv_source(store, dtype, bits, 32, rope, u, ks))
                    done = subprocess.run(
                        [
                            nvcc,
                            f"-arch={args.arch}",
                            "-cubin",
                            "-std=c++17",
                            "-Xptxas",
                            "-v",
                            "-o",
                            str(cu.with_suffix(".cubin")),
                            str(cu),
                        ],
                        capture_output=True,
                        text=True,
                    )
                    regs = re.findall(r"Used (\d+) registers", done.stderr)
                    spill = re.findall(r"(\d+) bytes spill stores", done.stderr)
                    status = "ok" if done.returncode == 0 else "FAILED"
                    print(f"{cu.stem}: {status}, registers {regs}, spill stores {spill}")
                    if done.returncode:
                        failed += 1
                        print(done.stderr[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
