#!/usr/bin/env python3
"""Re-make tests/data/llamacpp_arch.json: llama.cpp's outputs on the tiny synthetic model of each
architecture (``gguf_factory.ARCH_MODELS``), the oracle of tests/test_architectures.py.

Run from the project root with Strata's environment, giving a Python that has llama-cpp-python:

    .venv/bin/python tests/make_arch_references.py --llama-python /tmp/lcpp-venv/bin/python

With ``--moe`` it does the same for the mixture-of-experts models (``gguf_factory.MOE_MODELS``,
tests/test_moe_architectures.py) into tests/data/llamacpp_moe.json.

It writes each model with ``gguf_factory.write_arch_model`` (SmolLM2's tokenizer, from the
catalog), then runs llama.cpp on it in that other Python, for every case of
tests/data/cases_visible.json and tests/data/cases_arch.json: the prompt's token ids (plain
prompts with the model's own BOS rule; chat cases rendered with the GGUF's chat template by
jinja2, generation prompt added, special tokens parsed, no second BOS), the top-10 logits after
the prompt, and 32 greedy tokens with the top-5 logits at each step — the format of
shared/reference (shared/models.md). Each entry carries the GGUF's sha256, which the tests
check against the file they regenerate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

from gguf_factory import ARCH_MODELS, MOE_MODELS, moe_key_variant, write_arch_model  # noqa: E402

OUT = TESTS / "data" / "llamacpp_arch.json"
MOE_OUT = TESTS / "data" / "llamacpp_moe.json"
CASE_FILES = (TESTS / "data" / "cases_visible.json", TESTS / "data" / "cases_arch.json")
GEMMA_OUT = TESTS / "data" / "llamacpp_gemma3.json"
GEMMA_CASES = TESTS / "data" / "cases_gemma3.json"
"""Our own prompts for the real Gemma-3-270M file (``--gemma``), beside shared/reference's case."""
GREEDY = 32
N_CTX = 512

RUNNER = r"""
import json, sys
import jinja2
import llama_cpp
import numpy as np
from llama_cpp import Llama

jobs = json.loads(sys.stdin.read())
out = []
for job in jobs:
    m = Llama(model_path=job["path"], n_ctx=job["n_ctx"], logits_all=True, seed=0, n_threads=2,
              verbose=False)
    meta = m.metadata
    for case in job["cases"]:
        if "messages" in case:
            bos = m.detokenize([m.token_bos()], special=True).decode()
            eos = m.detokenize([m.token_eos()], special=True).decode()
            text = jinja2.Template(meta["tokenizer.chat_template"]).render(
                messages=case["messages"], add_generation_prompt=True, bos_token=bos,
                eos_token=eos)
            ids = m.tokenize(text.encode(), add_bos=False, special=True)
        else:
            text = case["prompt"]
            ids = m.tokenize(text.encode(), add_bos=True, special=False)
        m.reset()
        m.eval(ids)
        def top(k):
            row = np.array(m.scores[m.n_tokens - 1], dtype=np.float32)
            idx = np.argsort(-row, kind="stable")[:k]
            return [[int(i), round(float(row[i]), 4)] for i in idx]
        top10 = top(10)
        greedy, steps = [], []
        for _ in range(job["greedy"]):
            t5 = top(5)
            steps.append(t5)
            greedy.append(t5[0][0])
            m.eval([t5[0][0]])
        out.append({
            "model": job["name"],
            "model_file": job["file"],
            "model_sha256": job["sha256"],
            "case": case["id"],
            "rendered_prompt": text,
            "prompt_ids": ids,
            "top10_after_prompt": top10,
            "greedy_ids": greedy,
            "greedy_step_top5": steps,
            "reference": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}, "
                         f"n_ctx={job['n_ctx']}, 2 threads, CPU",
        })
    del m
print(json.dumps(out))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python")
    p.add_argument("-o", "--output", type=Path, help=f"default {OUT.name} ({MOE_OUT.name})")
    p.add_argument(
        "--gemma", action="store_true", help=f"the real Gemma-3-270M on {GEMMA_CASES.name} instead"
    )
    p.add_argument("--moe", action="store_true", help="the MoE models (MOE_MODELS) instead")
    args = p.parse_args()

    from planner.catalog import resolve_model

    if args.gemma:
        gemma = resolve_model("gemma3-270m")
        job = {
            "name": "gemma3-270m",
            "path": str(gemma.path),
            "file": gemma.path.name,
            "sha256": gemma.sha256,
            "n_ctx": N_CTX,
            "greedy": GREEDY,
            "cases": json.loads(GEMMA_CASES.read_text()),
        }
        _write(_run(args.llama_python, [job]), GEMMA_OUT)
        return 0

    tokenizer = resolve_model("smollm2-135m").path
    cases = [c for f in CASE_FILES for c in json.loads(f.read_text())]
    with tempfile.TemporaryDirectory() as d:
        jobs = []
        for name in MOE_MODELS if args.moe else ARCH_MODELS:
            path = write_arch_model(Path(d) / f"strata-synthetic-{name}.gguf", name, tokenizer)
            jobs.append(
                {
                    "name": name,
                    "path": str(path),
                    "file": path.name,
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                    "n_ctx": N_CTX,
                    "greedy": GREEDY,
                    "cases": cases,
                }
            )
        refs = _run(args.llama_python, jobs)
        if args.moe:
            _check_key_variants(args.llama_python, jobs, refs, Path(d), tokenizer)
    _write(refs, args.output or (MOE_OUT if args.moe else OUT))
    return 0


def _check_key_variants(
    llama_python: str, jobs: list[dict], refs: list[dict], d: Path, tokenizer: Path
) -> None:
    """llama.cpp ignores the GGUF routing keys for the MoE architectures here: on each model's
    ``moe_key_variant`` its outputs for the first case must equal the plain file's (else the
    architectures' routing rows in ``executor/models`` must name the keys it reads).

    Raises:
        SystemExit: llama.cpp's outputs differ on some variant (names it).
    """
    variants = []
    for job in jobs:
        path = write_arch_model(
            d / f"keys-{job['name']}.gguf", job["name"], tokenizer,
            model=moe_key_variant(job["name"]),
        )  # fmt: skip
        variants.append({**job, "path": str(path), "cases": job["cases"][:1]})
    fields = ("prompt_ids", "top10_after_prompt", "greedy_ids", "greedy_step_top5")
    for got in _run(llama_python, variants):
        want = next(r for r in refs if (r["model"], r["case"]) == (got["model"], got["case"]))
        if any(got[f] != want[f] for f in fields):
            raise SystemExit(
                f"llama.cpp's outputs on {got['model']} with expert_weights_norm, "
                "expert_gating_func and expert_weights_scale set differ from the plain file's: "
                "it reads those keys now; update the routing rows (MoeRouting.gguf_keys)"
            )
    print(f"llama.cpp ignored the routing keys on all {len(variants)} variants", file=sys.stderr)


def _run(llama_python: str, jobs: list[dict]) -> list[dict]:
    """llama.cpp's outputs for ``jobs`` (RUNNER in a Python that has llama-cpp-python)."""
    done = subprocess.run(
        [llama_python, "-c", RUNNER], input=json.dumps(jobs), capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def _write(refs: list[dict], path: Path) -> None:
    path.write_text(json.dumps(refs, indent=1) + "\n")
    print(f"wrote {path}: {len(refs)} entries", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
