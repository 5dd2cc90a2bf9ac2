"""The cost of checking every streamed read of the packed store against its CRC-32.

Plans SmolLM2-135M with every unit on NVMe (``--tiers nvme``), loads it once, then decodes the
same greedy request with the check on and off in turn (pairs, so a drifting machine moves both
alike) and prints each side's median decode tokens/s, their ratio, the bytes checked per token
and zlib.crc32's bytes/s over a pool slot's memory. The check is always on in Strata: turning it
off (``strata.executor.pack._CHECK_READS``) is for this measurement only.

Usage: .venv/bin/python scripts/measure_pack_crc.py [--pairs N] [--tokens N] [--context N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import mlx.core as mx
from strata.common.schemas import Request
from strata.common.yamlio import write_yaml
from strata.executor import pack
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine
from strata.planner.planning import build_plan

PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "dev-linux-cpu.yaml"


def crc_rate(nbytes: int = 64 << 20, runs: int = 5) -> float:
    """zlib.crc32's bytes/s over an MLX uint8 array's memory (what a pool slot is), median."""
    a = mx.zeros((nbytes,), dtype=mx.uint8) + 7
    mx.eval(a)
    mv = memoryview(a).cast("B")
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        zlib.crc32(mv)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    plan = Path(tempfile.mkdtemp()) / "all-nvme.yaml"
    req = Request(context=args.context, concurrency=1, tiers=["nvme"])
    write_yaml(build_plan("smollm2-135m", PROFILE, req), plan)
    serving = ServingEngine(Engine(load_plan(plan)))
    serving.start()
    prompt = serving.tokenizer.encode("The capital of France is")
    rates: dict[bool, list[float]] = {True: [], False: []}
    ratios, ids, nvme = [], {}, {}
    try:
        generate(serving, prompt, SamplingParams(), args.tokens, stop_at_eog=False)  # warm-up
        for _ in range(args.pairs):
            pair = {}
            for check in (True, False):
                pack._CHECK_READS = check
                gen = generate(serving, prompt, SamplingParams(), args.tokens, stop_at_eog=False)
                pair[check] = gen.stats["decode_tok_s"]
                rates[check].append(pair[check])
                ids[check] = gen.output_ids
                nvme[check] = gen.stats["bytes_read"]["nvme"] / len(gen.output_ids)
            ratios.append(pair[True] / pair[False])
    finally:
        pack._CHECK_READS = True
        serving.close()
    assert ids[True] == ids[False], "the check changed the tokens"
    for check, label in ((True, "on: "), (False, "off:")):
        runs = sorted(round(r, 2) for r in rates[check])
        print(f"decode tok/s, check {label} median {statistics.median(rates[check]):.2f} {runs}")
    pairs = sorted(round(r, 3) for r in ratios)
    print(f"on/off decode ratio per pair: median {statistics.median(ratios):.3f} {pairs}")
    print(f"streamed bytes per token: {nvme[True] / 1e6:.1f} MB")
    print(f"zlib.crc32 over slot memory: {crc_rate() / 1e9:.2f} GB/s (one thread)")


if __name__ == "__main__":
    main()
