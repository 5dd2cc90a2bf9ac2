#!/usr/bin/env python3
"""Write a synthetic GGUF: a real model's shape and quant types, random weights, SmolLM2's
tokenizer.

For exercising tier streaming at sizes no real test model here reaches; llama.cpp runs the files
too. Dense llama shapes and mixture-of-experts shapes (Mixtral: llama with experts; Qwen3-MoE:
qwen3moe). MoE routing is uniform, or skewed and correlated across layers like a trained model's
(--routing skewed), or whatever plain random routers do (--routing random). Argument parsing
only: the work is in planner/synthetic.py (the construction) and planner/synthetic_routing.py
(the routing design and its statistics).
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
        experts=args.experts,
        experts_used=args.experts_used,
    )
    m = write_synthetic(
        args.output,
        shape,
        ftype=args.ftype,
        seed=args.seed,
        tokenizer=args.tokenizer,
        logit_std=args.logit_std,
        routing=args.routing,
        progress=True,
    )
    moe = f", {m.shape.experts_used} of {m.shape.experts} experts, {m.routing} routing"
    print(
        f"wrote {m.path}: {m.shape.name} {m.ftype}{moe if m.shape.experts else ''}, "
        f"{m.n_params / 1e6:,.1f} M weights, {format_size(m.size_bytes)}",
        file=sys.stderr,
    )


def _presets() -> str:
    from planner.synthetic import SHAPES

    def line(s) -> str:
        moe = f", {s.experts} experts ({s.experts_used} used)" if s.experts else ""
        return (
            f"  {s.name:<14} {s.arch}: {s.layers} layers, width {s.width}, ffn {s.ffn}{moe}, "
            f"{s.heads}/{s.kv_heads} heads of {s.head_dim}"
        )

    return "presets:\n" + "\n".join(line(s) for s in SHAPES.values())


def main(argv: list[str] | None = None) -> int:
    from planner.synthetic import FTYPES, ROUTING, SHAPES
    from planner.synthetic_routing import TARGET_LIFT, TARGET_SHARE

    p = argparse.ArgumentParser(
        prog="synth.py",
        description=__doc__,
        epilog=_presets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", required=True, help=f"preset: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, help="override the number of blocks")
    p.add_argument("--width", type=int, help="override the embedding length")
    p.add_argument("--ffn", type=int, help="override the feed-forward length (per expert for MoE)")
    p.add_argument("--heads", type=int, help="override the query head count")
    p.add_argument("--kv-heads", type=int, help="override the key/value head count")
    p.add_argument(
        "--experts",
        type=int,
        help="override the experts per MoE block (0 makes a llama MoE shape dense)",
    )
    p.add_argument("--experts-used", type=int, help="override the experts chosen per token")
    routing_help = (
        f"{', '.join(ROUTING)}: MoE shapes' routers. 'uniform' (default): every expert equally "
        "likely, layers independent. 'skewed': each layer's top quarter of experts takes about "
        f"{TARGET_SHARE * 100:.0f}%% of the selections, and an expert's designated successor in "
        f"the next layer fires about {TARGET_LIFT:g}x more often than chance when it fired. Both "
        "are built into the weights (a token's routing then depends on its id only; they need "
        "--width 128 or more, skewed at least 4 experts) and their files differ only in the "
        "routers. 'random': plain random routers, nothing designed (not uniform: a random "
        "model's residual stream drifts to a shared component that biases them, more with "
        "depth). See planner/synthetic.py"
    )
    p.add_argument("--routing", default="uniform", help=routing_help)
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
