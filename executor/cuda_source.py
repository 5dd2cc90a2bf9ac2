"""Kernel source as MLX's CUDA backend is given it.

``mx.fast.cuda_kernel`` writes the whole kernel source (header, signature, body) into a new
string at every call, and hashes it at every evaluation to find the compiled module
(``mlx/backend/cuda/custom_kernel.cpp``, MLX 0.32: ``build_kernel``, ``std::hash`` of
``source_`` in ``CustomKernel::eval_gpu``). That host work grows with the source's length, and a
forward pass makes a few hundred such calls: measured on the H200 host (2026-12-01), a call of
Strata's 9 KB tensor-core kernel cost 25 us of host time against 8.6 us for MLX's own quantized
matmul. Comments and indentation, which are most of a readable source, are dropped before MLX
sees it.
"""

from __future__ import annotations

__all__ = ["compact"]


def compact(source: str) -> str:
    """``source`` (CUDA C++) without ``//`` comments, indentation and blank lines; one line per
    line kept (preprocessor directives such as ``#pragma unroll`` need their own line, and a
    macro's lines keep their closing backslash).

    Raises:
        ValueError: a line has a quote before its ``//`` (the marker could be inside a string
            literal) or a ``/* */`` comment: Strata's kernels have neither.
    """
    out = []
    for line in source.splitlines():
        cut = line.find("//")
        code = line if cut < 0 else line[:cut]
        if "/*" in code or (cut >= 0 and ('"' in code or "'" in code)):
            raise ValueError(
                f"cuda_source.compact: cannot tell a comment in {line.strip()!r}; write // "
                "comments on lines without string literals, and no /* */ comments"
            )
        code = code.strip()
        if code.endswith("\\"):  # a macro's line: the padding before its backslash goes too
            code = code[:-1].rstrip() + " \\"
        if code:
            out.append(code)
    return "\n".join(out) + "\n"
