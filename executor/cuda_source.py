"""Kernel source as MLX's CUDA backend is given it.

``mx.fast.cuda_kernel`` writes the whole kernel source (header, signature, body) into a new
string at every call, and hashes it at every evaluation to find the compiled module
(``mlx/backend/cuda/custom_kernel.cpp``, MLX 0.32: ``build_kernel``, ``std::hash`` of
``source_`` in ``CustomKernel::eval_gpu``). That host work grows with the source's length, and a
forward pass makes a few hundred such calls: a call of Strata's 9 KB tensor-core kernel cost
about three times MLX's own quantized matmul (docs/kernels.md#the-tensor-core-4-bit-matmul).
Comments and indentation, which are most of a readable source, are dropped before MLX
sees it.
"""

from __future__ import annotations

import functools
import re

import mlx.core as mx

__all__ = ["MIN_SM", "MMA_M16N8K16", "compact", "tensor_cores"]


def compact(source: str) -> str:
    """``source`` (CUDA C++) without ``//`` comments, indentation and blank lines; one line per
    line kept (preprocessor directives such as ``#pragma unroll`` need their own line, and a
    macro's lines keep their closing backslash).

    Raises:
        ValueError: where dropping text could change the code, none of which Strata's kernels
            do: a quote before a line's ``//`` (the marker could be inside a string literal), a
            ``/* */`` comment, a ``//`` comment ending in a backslash (C continues it onto the
            next line), a backslash continuing a string literal, or a continued line followed
            by a line with no code (dropping it would join the next code line to the macro).
    """
    out = []
    continued = False  # the previous line kept ends with a backslash
    for line in source.splitlines():
        cut = line.find("//")
        code = line if cut < 0 else line[:cut]
        code_stripped = code.strip()
        if (
            "/*" in code
            or (cut >= 0 and ('"' in code or "'" in code))
            or (cut >= 0 and line.rstrip().endswith("\\"))
            or (code_stripped.endswith("\\") and code.count('"') % 2)
            or (continued and not code_stripped)
        ):
            raise ValueError(
                f"cuda_source.compact: cannot compact {line.strip()!r} safely; write // "
                "comments on lines without string literals or a closing backslash, no /* */ "
                "comments, and no blank or comment-only line inside a macro"
            )
        code = code_stripped
        continued = code.endswith("\\")
        if continued:  # a macro's line: the padding before its backslash goes too
            code = code[:-1].rstrip() + " \\"
        if code:
            out.append(code)
    return "\n".join(out) + "\n"


MMA_M16N8K16 = r"""
// One m16n8k16 tensor-core product with float32 accumulators: c += a (16x16, row-major) * b
// (16x8, column-major), in the register layout of PTX's mma.sync (PTX ISA, "Matrix Fragments
// for mma.m16n8k16"): lane (g, t) = (lane / 4, lane % 4) holds a's rows g and g + 8 at
// columns 2t, 2t + 1 and 2t + 8, 2t + 9, b's column g at rows 2t, 2t + 1 and 2t + 8, 2t + 9, and
// c's rows g and g + 8 at columns 2t, 2t + 1.
// One overload per 16-bit type (the pointer argument selects it; PTX names the type).
#define STRATA_MMA(TYPE, PTX)                                                                  \
    __device__ __forceinline__ void strata_mma(float* c, uint4 a, uint2 b, const TYPE*) {      \
        asm volatile(                                                                          \
            "mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "                       \
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                \
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                   \
            : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));                     \
    }
STRATA_MMA(__half, "f16")
STRATA_MMA(__nv_bfloat16, "bf16")
#undef STRATA_MMA
"""
"""``strata_mma(c, a, b, tag)``: one PTX ``mma.sync.m16n8k16`` tensor-core product with float32
accumulators for float16 and bfloat16 (``tag``: a null pointer of the 16-bit type), for the
kernels' source (``executor.cuda_mma``, ``executor.cuda_attention``)."""

MIN_SM = 80
"""Compute capability (major * 10 + minor) Strata's CUDA kernels need: ``mma.sync.m16n8k16`` of
float16 and bfloat16 and ``cp.async`` (PTX ISA: sm_80 and later)."""


def tensor_cores() -> bool:
    """Whether this process computes on MLX's CUDA backend on a GPU that runs Strata's kernels
    (``MIN_SM`` or later, by the ``architecture`` MLX reports, e.g. ``"sm_90"``; where MLX
    reports none, the GPU is assumed to)."""
    if not mx.cuda.is_available():
        return False
    sm = _compute_capability()
    return sm is None or sm >= MIN_SM


@functools.cache
def _compute_capability() -> int | None:
    try:
        arch = str(mx.device_info().get("architecture", ""))
    except Exception:  # an MLX without device_info: nothing known
        return None
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    return int(m.group(1)) if m else None
