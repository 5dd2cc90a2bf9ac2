#!/usr/bin/env python3
"""Re-make the example plans checked in under plans/ and print the table of the published anchors.

Run from the project root:

- ``.venv/bin/python scripts/make_plans.py`` re-makes every plan (``tests/planner/test_plans.py``
  keeps them current); ``scripts/make_plans.py NAME...`` only those plan files;
- ``.venv/bin/python scripts/make_plans.py --anchors`` prints the table of docs/anchors.md: each
  published anchor beside what its checked-in plan predicts and decides
  (``tests/planner/test_anchor_plans.py`` checks that the doc's table is this output).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import NamedTuple

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata.common.schemas import (  # noqa: E402
    Cluster,
    ExpertCache,
    Plan,
    Prediction,
    Request,
    TierMemory,
)
from strata.common.yamlio import document_text, write_yaml  # noqa: E402
from strata.planner.archdesc import describe_arch  # noqa: E402
from strata.planner.cluster import build_cluster_plan  # noqa: E402
from strata.planner.planning import build_plan  # noqa: E402

# plan file -> (model, profile file, request); a model is a catalog name, or (architecture file
# under profiles/arch/, llama.cpp file type) for a model described without its weights; a
# profile under clusters/ is a cluster description (strata plan --cluster).
EXAMPLES: dict[str, tuple[str | tuple[str, str], str, dict]] = {
    "smollm2-135m.dev-linux-cpu.yaml": ("smollm2-135m", "dev-linux-cpu.yaml", {"context": 2048}),
    "smollm2-135m.m1-max-32gb.yaml": ("smollm2-135m", "m1-max-32gb.yaml", {"context": 8192}),
    "smollm2-135m.h200-host.yaml": (
        "smollm2-135m",
        "h200-host.yaml",
        {"context": 8192, "concurrency": 16, "objective": "throughput"},
    ),
    # The published benchmark machine and models (shared/anchor-models.md).
    "qwen2.5-14b-q4_k_m.m1-max-32gb.yaml": (
        ("qwen2.5-14b.yaml", "Q4_K_M"),
        "m1-max-32gb.yaml",
        {"context": 4096},
    ),
    "llama-3.3-70b-q4_k_m.m1-max-32gb.yaml": (
        ("llama-3.3-70b.yaml", "Q4_K_M"),
        "m1-max-32gb.yaml",
        {"context": 4096},
    ),
    "mixtral-8x7b-q5_k_m.m1-max-32gb.yaml": (
        ("mixtral-8x7b.yaml", "Q5_K_M"),
        "m1-max-32gb.yaml",
        {"context": 4096},
    ),
    # The big-MoE anchors of issue 37 (docs/anchors.md).
    "qwen3-coder-next-80b-a3b-q4_k_m.m1-max-32gb.yaml": (
        ("qwen3-coder-next-80b-a3b.yaml", "Q4_K_M"),
        "m1-max-32gb.yaml",
        {"context": 4096},
    ),
    # Q4_0: 4.5 bits per weight as Flash-MoE's MLX 4-bit experts (a float16 scale and bias per
    # 64 weights) are; Strata's MLX form of Q4_K_M would be 300.5 GiB against Q4_0's 231.6.
    "qwen3.5-397b-a17b-q4_0.m3-max-48gb.yaml.gz": (
        ("qwen3.5-397b-a17b.yaml", "Q4_0"),
        "m3-max-48gb.yaml",
        {"context": 4096},
    ),
    "gpt-oss-120b-mxfp4.m4-max-128gb.yaml": (
        ("gpt-oss-120b.yaml", "MXFP4_MOE"),
        "m4-max-128gb.yaml",
        {"context": 4096},
    ),
    "deepseek-v3-q4_k_m.m3-ultra-512gb.yaml": (
        ("deepseek-v3.yaml", "Q4_K_M"),
        "m3-ultra-512gb.yaml",
        {"context": 4096},
    ),
    # Issue 39's planning-only acceptance: the same model over two of those Macs (docs/clusters.md).
    "deepseek-v3-q4_k_m.m3-ultra-512gb-x2-tb5.yaml.gz": (
        ("deepseek-v3.yaml", "Q4_K_M"),
        "clusters/m3-ultra-512gb-x2-tb5.yaml",
        {"context": 4096},
    ),
}

SLOW: frozenset[str] = frozenset(
    {
        "deepseek-v3-q4_k_m.m3-ultra-512gb.yaml",
        "deepseek-v3-q4_k_m.m3-ultra-512gb-x2-tb5.yaml.gz",
        "qwen3-coder-next-80b-a3b-q4_k_m.m1-max-32gb.yaml",
        "qwen3.5-397b-a17b-q4_0.m3-max-48gb.yaml.gz",
    }
)
"""Plans whose re-making takes more than a few seconds (tens of thousands of expert units: the
ILP and the YAML writer take 10-30 s each); their currency test is marked slow."""

SLOW_TIME_LIMIT_S = 600
"""The ILP's wall-clock guard for the ``SLOW`` plans, seconds (their provenance records it)."""


# --------------------------------------------------------------------------- the anchor table


class Anchor(NamedTuple):
    """A published result and the checked-in plan set beside it (docs/anchors.md).

    Attributes:
        plan: the plan file under plans/ (one of ``EXAMPLES``).
        model: the model and file type as the table names them.
        machine: the machine as the table names it.
        published: the published decode figure, tokens/s, as its source gives it.
        how: the published run in a few words (engine, what it kept where).
        source: where the figure is published (URL or repository path).
    """

    plan: str
    model: str
    machine: str
    published: str
    how: str
    source: str


ANCHORS: list[Anchor] = [
    Anchor(
        plan="qwen3.5-397b-a17b-q4_0.m3-max-48gb.yaml.gz",
        model="Qwen3.5-397B-A17B Q4_0",
        machine="M3 Max 48 GB",
        published="4.36",
        how="Flash-MoE on the same machine: C/Metal, MLX 4-bit experts read from the SSD with "
        "pread through the OS page cache (about 71% hit rate), 4 experts per token where the "
        "model routes 10",
        source="github.com/danveloper/flash-moe, README",
    ),
    Anchor(
        plan="qwen3-coder-next-80b-a3b-q4_k_m.m1-max-32gb.yaml",
        model="Qwen3-Coder-Next (80B-A3B) Q4_K_M",
        machine="M1 Max 32 GB",
        published="1.3 (its committed runs: 1.01-1.26)",
        how="Hypura on the same machine: llama.cpp with the experts streamed from NVMe; plain "
        "llama.cpp with every layer on the CPU through mmap measured 2.60-3.43 in the same "
        "project's committed runs",
        source="github.com/t8/hypura, benchmarks/README.md and benchmarks/results/",
    ),
    Anchor(
        plan="mixtral-8x7b-q5_k_m.m1-max-32gb.yaml",
        model="Mixtral-8x7B-Instruct-v0.1 Q5_K_M",
        machine="M1 Max 32 GB",
        published="2.2 (its committed runs: 1.85-1.93)",
        how="Hypura on the same machine: llama.cpp with the experts streamed from NVMe",
        source="github.com/t8/hypura, benchmarks/README.md and benchmarks/results/",
    ),
    Anchor(
        plan="gpt-oss-120b-mxfp4.m4-max-128gb.yaml",
        model="gpt-oss-120b MXFP4_MOE",
        machine="M4 Max 128 GB",
        published="25.62",
        how="another machine: llama.cpp `--n-cpu-moe 36` (every expert on the CPU) on an Intel "
        "i9-14900K with an 8 GB GPU; 24.96 in ik_llama.cpp on an RTX 4080 + Threadripper 5975WX",
        source="a Hacker News comment, mirrored at gokawiil.com/article/74814; "
        "ikawrakow/ik_llama.cpp PR #829",
    ),
    Anchor(
        plan="deepseek-v3-q4_k_m.m3-ultra-512gb.yaml",
        model="DeepSeek-V3 Q4_K_M",
        machine="M3 Ultra 512 GB",
        published="11.26",
        how="another machine: KTransformers V0.2 on 2 x Xeon Gold 6454S (382 GB of DRAM used) + "
        "an RTX 4090D; llama.cpp on the same machine: 4.51",
        source="kvcache-ai/ktransformers, doc/en/DeepseekR1_V3_tutorial.md",
    ),
    Anchor(
        plan="deepseek-v3-q4_k_m.m3-ultra-512gb-x2-tb5.yaml.gz",
        model="DeepSeek-V3 Q4_K_M",
        machine="2 x M3 Ultra 512 GB, Thunderbolt 5",
        published="27.8 (one Mac: 21.1)",
        how="DeepSeek V3.1 in Exo 1.0 over RDMA on Thunderbolt 5 on Jeff Geerling's M3 Ultra Mac "
        "Studios (quantization and split not given in the comment); one M3 Ultra 512 GB in MLX "
        "4-bit: 17-18 (Dave2D's test); no published mlx-lm pipeline figure on two M3 Ultras was "
        "found (docs/clusters.md)",
        source="a Hacker News comment on jeffgeerling.com's \"1.5 TB of VRAM on Mac Studio - RDMA "
        "over Thunderbolt 5\" (item 46320247); wccftech.com on Dave2D's run",
    ),
]
"""The anchors of issue 37 whose architecture Strata describes, and issue 39's cluster anchor, in
the table's order."""

GiB = 1 << 30

# Top-level sections of a plan file that the table reads; the others (placement, costs) are the
# bulk of a large plan and are not parsed (the pure-Python loader reads ~0.4 MB/s). A cluster
# plan's ``cluster`` section is read too (its stages and prediction).
_SECTIONS = ("request", "expert_cache", "memory", "prediction")  # and the placement, by regex


def plan_summary(path: Path) -> dict:
    """The sections of plan file ``path`` the table reads, validated by their schemas.

    Returns:
        ``{"request": Request, "expert_cache": ExpertCache, "memory": {tier: TierMemory},
        "prediction": Prediction, "units": {kind: {tier: count}}, "weights": {tier: bytes},
        "cluster": Cluster | None}`` (a cluster plan's memory and expert cache are stage 0's;
        units and weights count every host's).

    Raises:
        ValueError: a section is missing or does not match its schema.
    """
    text = document_text(path)
    starts = [(m.group(1), m.start()) for m in re.finditer(r"^([a-z_]+):", text, re.MULTILINE)]
    bounds = {
        k: (s, starts[i + 1][1] if i + 1 < len(starts) else len(text))
        for i, (k, s) in enumerate(starts)
    }
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out: dict = {}
    for key in _SECTIONS:
        if key not in bounds:
            raise ValueError(f"{path}: no {key!r} section; re-make it with scripts/make_plans.py")
        s, e = bounds[key]
        out.update(yaml.load(text[s:e], Loader=loader))
    units: dict[str, dict[str, int]] = {}
    weights: dict[str, int] = {}
    s, e = bounds["placement"]
    for unit, tier, size in _PLACED.findall(text, s, e):
        kind = _KIND.get(unit) or _KIND[unit.split(".")[2]]
        units.setdefault(kind, {}).setdefault(tier, 0)
        units[kind][tier] += 1
        weights[tier] = weights.get(tier, 0) + int(size)
    cluster = None
    if "cluster" in bounds:
        s, e = bounds["cluster"]
        cluster = Cluster(**yaml.load(text[s:e], Loader=loader)["cluster"])
    return {
        "request": Request(**out["request"]),
        "expert_cache": ExpertCache(**out["expert_cache"]),
        "memory": {t: TierMemory(**m) for t, m in out["memory"].items()},
        "prediction": Prediction(**out["prediction"]),
        "units": units,
        "weights": weights,
        "cluster": cluster,
    }


_PLACED = re.compile(
    r"^  - \{unit: ([^,]+), tier: (\w+), bytes: (\d+)(?:, host: [^}]+)?\}$", re.MULTILINE
)
"""One placement entry as ``write_yaml`` writes it (a flow mapping on one line; a cluster
plan's names its host)."""

_KIND = {
    "token_embd": "embedding",
    "output": "head",
    "attn": "attention",
    "ffn": "router, shared or dense FFN",
    "expert": "experts",
}
"""What the table calls a unit: by name outside the blocks, by ``blk.N.<part>`` in them."""


def unit_kinds(plan: Plan) -> dict[str, dict[str, int]]:
    """Units per kind and tier, from a fully loaded plan (what :func:`plan_summary` counts)."""
    units: dict[str, dict[str, int]] = {}
    for p in plan.placement:
        kind = _KIND.get(p.unit) or _KIND[p.unit.split(".")[2]]
        units.setdefault(kind, {}).setdefault(p.tier, 0)
        units[kind][p.tier] += 1
    return units


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def decided(summary: dict) -> str:
    """What the plan decided, in one cell: weights per tier, units per kind and tier, the expert
    cache, the bottleneck."""
    cache, pred, w = summary["expert_cache"], summary["prediction"], summary["weights"]
    tiers = ", ".join(f"{t} {_gib(w[t])}" for t in ("gpu", "ram", "nvme") if w.get(t))
    parts = [f"weights GiB: {tiers}"]
    cluster = summary.get("cluster")
    if cluster is not None:  # the stage split; the expert cache below is stage 0's
        parts.insert(
            0,
            f"{len(cluster.stages)} hosts: "
            + ", ".join(f"{s.host} blk {s.first_block}-{s.end_block - 1}" for s in cluster.stages)
            + f"; binding {cluster.prediction.binding}",
        )
    for kind in _KIND.values():
        where = summary["units"].get(kind, {})
        if where:
            parts.append(
                f"{kind}: "
                + ", ".join(f"{t} {where[t]}" for t in ("gpu", "ram", "nvme") if t in where)
            )
    if cache.slots:
        parts.append(
            f"expert cache {cache.slots} slots ({_gib(cache.slots * cache.slot_bytes)} GiB)"
        )
    if pred.expert_hit_rate is not None:
        parts.append(f"predicted hit rate {pred.expert_hit_rate:.1%}")
    parts.append(f"{pred.bottleneck}-bound" + (" (the binding host)" if cluster else ""))
    return "; ".join(parts)


def anchor_row(anchor: Anchor, summary: dict) -> str:
    """One markdown row of the anchor table."""
    pred, req = summary["prediction"], summary["request"]
    ttft = " / ".join(f"{t:.2f}" for t in pred.ttft_s)
    prompts = " / ".join(str(p) for p in req.prompt_tokens)
    cells = [
        anchor.model,
        anchor.machine,
        anchor.published,
        f"{anchor.how} ({anchor.source})",
        f"[{anchor.plan}](../plans/{anchor.plan})",
        f"{pred.decode_tok_s:.2f}",
        f"{ttft} s ({prompts}-token prompt)",
        decided(summary),
    ]
    return "| " + " | ".join(cells) + " |"


TABLE_HEADER = (
    "| model | machine (profile) | published decode tok/s | published run (source) | plan | "
    "predicted decode tok/s | predicted TTFT | what the plan decided |\n"
    "|---|---|---|---|---|---|---|---|"
)


def anchor_table(plans_dir: Path = ROOT / "plans") -> str:
    """The markdown table of every anchor, read from the checked-in plans in ``plans_dir``."""
    rows = [anchor_row(a, plan_summary(plans_dir / a.plan)) for a in ANCHORS]
    return "\n".join([TABLE_HEADER, *rows])


DOC = ROOT / "docs" / "anchors.md"
BEGIN, END = "<!-- anchors:begin -->", "<!-- anchors:end -->"


def doc_table(doc: Path = DOC) -> str:
    """The table in ``doc`` between its ``BEGIN`` and ``END`` markers.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    text = doc.read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{doc}: no {BEGIN} ... {END} block for the anchor table")
    return text[i + len(BEGIN) : j].strip("\n")


def write_doc_table(doc: Path = DOC) -> None:
    """Replace the table in ``doc`` (between the markers) by :func:`anchor_table`."""
    text = doc.read_text()
    old = doc_table(doc)
    i = text.find(BEGIN) + len(BEGIN)
    j = text.find(END)
    assert old == text[i:j].strip("\n")
    doc.write_text(text[:i] + "\n" + anchor_table() + "\n" + text[j:])


# --------------------------------------------------------------------------- plans


def make(name: str) -> Plan:
    """The example plan ``name`` made afresh from its inputs."""
    model, profile, request = EXAMPLES[name]
    desc = None
    if isinstance(model, tuple):
        arch_file, ftype = model
        desc = describe_arch(ROOT / "profiles" / "arch" / arch_file, ftype)
    spec = model if isinstance(model, str) else None
    # The SLOW plans' ILPs take 10-20 s of CPU: a generous wall-clock guard keeps a busy machine
    # (CI, the tests run in parallel) from failing them; the plan is the same (planner.ilp).
    limit = SLOW_TIME_LIMIT_S if name in SLOW else 30
    if profile.startswith("clusters/"):
        return build_cluster_plan(
            spec, ROOT / "profiles" / profile, Request(**request), desc=desc, time_limit_s=limit
        )
    return build_plan(
        spec, ROOT / "profiles" / profile, Request(**request), desc=desc, time_limit_s=limit
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="plan files to re-make (default: all)")
    ap.add_argument(
        "--anchors", action="store_true", help="print docs/anchors.md's table from plans/"
    )
    ap.add_argument(
        "--write-doc", action="store_true", help="with --anchors: also write it into the doc"
    )
    args = ap.parse_args(argv)
    if args.anchors:
        print(anchor_table())
        if args.write_doc:
            write_doc_table()
        return 0
    unknown = [n for n in args.names if n not in EXAMPLES]
    if unknown:
        print(f"unknown plan(s) {', '.join(unknown)}; known: {', '.join(EXAMPLES)}")
        return 2
    for name in args.names or EXAMPLES:
        write_yaml(make(name), ROOT / "plans" / name)
        print(f"wrote plans/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
