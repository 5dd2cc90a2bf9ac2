#!/usr/bin/env python3
"""Write a synthetic GGUF: a real llama shape and quant type, random weights, SmolLM2's tokenizer.

For exercising tier streaming at sizes no real test model here reaches; llama.cpp runs the files
too. Argument parsing only: the work is in planner/synthetic.py.
"""

from __future__ import annotations

import argparse
import sys

from planner.errors import run_command


def _write(args: argparse.Namespace) -> None:
    from planner.sizes import format_size
    from planner.synthetic import shape_from_args, write_synthetic

    shape = shape_from_args(
        args.shape,
        layers=args.layers,
        width=args.width,
        ffn=args.ffn,
        heads=args.heads,
        kv_heads=args.kv_heads,
    )
    m = write_synthetic(
        args.output,
        shape,
        ftype=args.ftype,
        seed=args.seed,
        tokenizer=args.tokenizer,
        logit_std=args.logit_std,
        progress=True,
    )
    print(
        f"wrote {m.path}: {m.shape.name} {m.ftype}, {m.n_params / 1e6:,.1f} M weights, "
        f"{format_size(m.size_bytes)}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    from planner.synthetic import FTYPES, SHAPES

    p = argparse.ArgumentParser(prog="synth.py", description=__doc__)
    p.add_argument("--shape", required=True, help=f"preset: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, help="override the number of blocks")
    p.add_argument("--width", type=int, help="override the embedding length")
    p.add_argument("--ffn", type=int, help="override the feed-forward length")
    p.add_argument("--heads", type=int, help="override the query head count")
    p.add_argument("--kv-heads", type=int, help="override the key/value head count")
    p.add_argument("--ftype", default="Q4_0", help=f"{', '.join(FTYPES)} (default Q4_0)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--tokenizer",
        default="smollm2-135m",
        help="catalog name or GGUF path to copy tokenizer.* from (default smollm2-135m)",
    )
    p.add_argument(
        "--logit-std", type=float, default=3.0, help="target std of the logits (default 3)"
    )
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")
    args = p.parse_args(argv)
    return run_command(lambda: _write(args))


if __name__ == "__main__":
    sys.exit(main())
