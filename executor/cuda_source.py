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
