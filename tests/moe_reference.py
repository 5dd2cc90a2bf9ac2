"""An independent numpy forward pass of the synthetic models, as an oracle for their routing.

Not production code: written from llama.cpp's graphs (``src/models/llama.cpp``,
``src/models/qwen3moe.cpp``, ``build_moe_ffn`` in ``src/llama-graph.cpp``), it shares nothing with
the executor but the GGUF reader and ``gguf.quants.dequantize``. Architectures: ``llama`` (dense,
or Mixtral-style with experts) and ``qwen3moe``.

Per block, for hidden states h [T, d] (float32):

* attention: x = RMSNorm(h) * attn_norm; q, k, v = x Wq^T, x Wk^T, x Wv^T split into heads;
  qwen3moe: RMSNorm of every q and k head * attn_{q,k}_norm; RoPE at positions 0..T-1 with
  theta_i = base^(-2i / hd): llama rotates adjacent pairs (x[2i], x[2i+1]) (llama.cpp's
  ROPE_TYPE_NORM: GGUF llama Q/K rows are permuted for it), qwen3moe the halves (x[i], x[i+hd/2])
  (NEOX); causal softmax(q k^T / sqrt(hd)) v, each KV head shared by heads/kv_heads query heads;
  h += attn Wo^T;
* FFN: x = RMSNorm(h) * ffn_norm; dense: h += (silu(x Wg^T) * (x Wu^T)) Wd^T; MoE: p =
  softmax(x Wr^T) over all experts, the k largest chosen (ties to the lower id), weights p
  renormalized over the chosen (Mixtral and qwen3moe both pass norm_w = true), h += sum of
  weight * the chosen experts' SwiGLU.

Usage as a script (measures the routing statistics of a synthetic GGUF on ``SAMPLE_TEXT``):
``python tests/moe_reference.py MODEL.gguf [--tokens N]``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SAMPLE_TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. Now "
    "we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field, as a final resting place for those "
    "who here gave their lives that that nation might live. It is altogether fitting and proper "
    "that we should do this. But, in a larger sense, we can not dedicate -- we can not "
    "consecrate -- we can not hallow -- this ground. The brave men, living and dead, who "
    "struggled here, have consecrated it, far above our poor power to add or detract. The world "
    "will little note, nor long remember what we say here, but it can never forget what they did "
    "here. It is for us the living, rather, to be dedicated here to the unfinished work which "
    "they who fought here have thus far so nobly advanced. It is rather for us to be here "
    "dedicated to the great task remaining before us -- that from these honored dead we take "
    "increased devotion to that cause for which they gave the last full measure of devotion -- "
    "that we here highly resolve that these dead shall not have died in vain -- that this nation, "
    "under God, shall have a new birth of freedom -- and that government of the people, by the "
    "people, for the people, shall not perish from the earth. It was a bright cold day in April, "
    "and the clocks were striking thirteen. Call me Ishmael. Some years ago, never mind how long "
    "precisely, having little or no money in my purse, and nothing particular to interest me on "
    "shore, I thought I would sail about a little and see the watery part of the world. It is a "
    "way I have of driving off the spleen and regulating the circulation."
)
"""A few hundred tokens of public-domain English (the Gettysburg Address, the first lines of
Nineteen Eighty-Four and Moby-Dick): 383 tokens with SmolLM2's tokenizer."""


def reader(path: str | Path) -> gguf.GGUFReader:
    """The file's ``GGUFReader``, cached (parsing a 49152-token vocabulary takes over a second)."""
    st = Path(path).stat()
    return _reader(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


@dataclass
class Reference:
    """A GGUF opened for the reference forward pass.

    Attributes:
        path: the file.
        arch: ``general.architecture``.
        layers, width, heads, kv_heads, head_dim: the shape.
        n_expert, n_used: expert count and experts per token (0 for dense).
        rope_base, rms_eps: RoPE theta and RMSNorm epsilon.
        tensors: name -> the reader's tensor.
    """

    path: Path
    arch: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    n_expert: int
    n_used: int
    rope_base: float
    rms_eps: float
    tensors: dict = field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> Reference:
        """Read the metadata and tensor table (weights are dequantized per layer, on use)."""
        r = reader(path)

        def get(key: str, default=None):
            f = r.fields.get(key)
            return default if f is None else f.contents()

        arch = get("general.architecture")
        width, heads = (
            int(get(f"{arch}.embedding_length")),
            int(get(f"{arch}.attention.head_count")),
        )
        return cls(
            path=Path(path),
            arch=arch,
            layers=int(get(f"{arch}.block_count")),
            width=width,
            heads=heads,
            kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(get(f"{arch}.attention.key_length", width // heads)),
            n_expert=int(get(f"{arch}.expert_count", 0)),
            n_used=int(get(f"{arch}.expert_used_count", 0)),
            rope_base=float(get(f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tensors={t.name: t for t in r.tensors},
        )

    def weight(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, numpy order ([rows, cols], [E, rows, cols])."""
        t = self.tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        """``token_embd`` rows of ``ids``, float32 [T, d] (only those rows are dequantized)."""
        t = self.tensors["token_embd.weight"]
        return np.asarray(gguf.quants.dequantize(t.data[ids], t.tensor_type), dtype=np.float32)


@dataclass
class ForwardResult:
    """What :func:`forward` recorded.

    Attributes:
        chosen: int64 [T, L, k], the experts each token chose per layer, in the router's
            order (largest probability first); None for a dense model.
        weights: float32 [T, L, k], their renormalized weights; None for dense.
        router_logits: float32 [T, L, E]; None for dense.
        rms: float64 [L], the mean over tokens of rms(h) at each block's FFN input.
        logits: float32 [T, vocab] when asked for, else None.
    """

    chosen: np.ndarray | None
    weights: np.ndarray | None
    router_logits: np.ndarray | None
    rms: np.ndarray
    logits: np.ndarray | None


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, times w."""
    return (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)).astype(
        np.float32
    ) * w


def rope(x: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """RoPE of x [T, H, hd] at positions 0..T-1 (see the module docstring)."""
    t, _, hd = x.shape
    theta = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # [hd/2]
    ang = np.arange(t, dtype=np.float64)[:, None] * theta[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if neox:
        out[..., : hd // 2], out[..., hd // 2 :] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x)."""
    return x / (1.0 + np.exp(-x))


def attention(m: Reference, x: np.ndarray, p: str) -> np.ndarray:
    """One block's attention output [T, d] for normalized input x [T, d]."""
    t, hd = x.shape[0], m.head_dim
    q = (x @ m.weight(p + "attn_q.weight").T).reshape(t, m.heads, hd)
    k = (x @ m.weight(p + "attn_k.weight").T).reshape(t, m.kv_heads, hd)
    v = (x @ m.weight(p + "attn_v.weight").T).reshape(t, m.kv_heads, hd)
    if m.arch == "qwen3moe":
        q = rms_norm(q, m.weight(p + "attn_q_norm.weight"), m.rms_eps)
        k = rms_norm(k, m.weight(p + "attn_k_norm.weight"), m.rms_eps)
    neox = m.arch == "qwen3moe"
    q, k = rope(q, m.rope_base, neox), rope(k, m.rope_base, neox)
    group = m.heads // m.kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [T, H, hd]
    scores = np.einsum("qhd,khd->hqk", q, k).astype(np.float64) / np.sqrt(hd)
    scores[:, ~np.tri(t, dtype=bool)] = -np.inf
    a = np.exp(scores - scores.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", a.astype(np.float32), v).reshape(t, m.heads * hd)
    return out @ m.weight(p + "attn_output.weight").T


def route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, top k (ties to the lower id), renormalized: (chosen, weights)."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, chosen, axis=-1)
    return chosen, (w / w.sum(-1, keepdims=True)).astype(np.float32)


def forward(m: Reference, ids: list[int], *, logits: bool = False) -> ForwardResult:
    """Run ``ids`` (positions 0..T-1) through every block; record the routing (and logits)."""
    ids_arr = np.asarray(ids, dtype=np.int64)
    h = m.embedding_rows(ids_arr)
    t, n_layers = len(ids_arr), m.layers
    moe = m.n_expert > 0
    chosen = np.zeros((t, n_layers, m.n_used), dtype=np.int64) if moe else None
    weights = np.zeros((t, n_layers, m.n_used), dtype=np.float32) if moe else None
    router = np.zeros((t, n_layers, m.n_expert), dtype=np.float32) if moe else None
    rms = np.zeros(n_layers)
    for i in range(n_layers):
        p = f"blk.{i}."
        h = h + attention(m, rms_norm(h, m.weight(p + "attn_norm.weight"), m.rms_eps), p)
        rms[i] = np.sqrt((h.astype(np.float64) ** 2).mean(-1)).mean()
        x = rms_norm(h, m.weight(p + "ffn_norm.weight"), m.rms_eps)
        if not moe:
            g, u = x @ m.weight(p + "ffn_gate.weight").T, x @ m.weight(p + "ffn_up.weight").T
            h = h + (silu(g) * u) @ m.weight(p + "ffn_down.weight").T
            continue
        lg = x @ m.weight(p + "ffn_gate_inp.weight").T  # [T, E]
        c, w = route(lg, m.n_used)
        chosen[:, i], weights[:, i], router[:, i] = c, w, lg
        gate, up = m.weight(p + "ffn_gate_exps.weight"), m.weight(p + "ffn_up_exps.weight")
        down = m.weight(p + "ffn_down_exps.weight")
        out = np.zeros_like(h)
        for e in np.unique(c):
            tok, slot = np.nonzero(c == e)
            xs = x[tok]
            y = (silu(xs @ gate[e].T) * (xs @ up[e].T)) @ down[e].T
            np.add.at(out, tok, w[tok, slot][:, None] * y)
        h = h + out
    out_logits = None
    if logits:
        x = rms_norm(h, m.weight("output_norm.weight"), m.rms_eps)
        out_logits = x @ m.weight("output.weight").T
    return ForwardResult(chosen, weights, router, rms, out_logits)


def sample_ids(path: str | Path, tokens: int | None = None) -> list[int]:
    """``SAMPLE_TEXT`` tokenized with the model's own tokenizer (the first ``tokens`` ids)."""
    from executor.tokenizer import GGUFTokenizer

    ids = GGUFTokenizer.from_reader(reader(path)).encode(SAMPLE_TEXT)
    return ids if tokens is None else ids[:tokens]


def measure(path: str | Path, tokens: int | None = None):
    """Routing statistics of a synthetic MoE GGUF on ``SAMPLE_TEXT`` (with its own seed's
    successors): (RoutingStats, ForwardResult)."""
    from planner.synthetic_routing import file_successors, routing_stats

    m = Reference.open(path)
    res = forward(m, sample_ids(path, tokens))
    return routing_stats(res.chosen, m.n_expert, file_successors(reader(path))), res


def main() -> int:
    p = argparse.ArgumentParser(description="Routing statistics of a synthetic MoE GGUF.")
    p.add_argument("model", help="GGUF written by synth.py with an MoE shape")
    p.add_argument("--tokens", type=int, help="use only the first N tokens of the sample text")
    args = p.parse_args()
    stats, res = measure(args.model, args.tokens)
    print(stats.summary())
    print("share per layer:", " ".join(f"{x:.2f}" for x in stats.share_per_layer))
    print("lift per pair:  ", " ".join(f"{x:.2f}" for x in stats.lift_per_pair))
    print("rms(h) per layer:", " ".join(f"{x:.2f}" for x in res.rms))
    print("mean top-1 weight:", f"{res.weights[:, :, 0].mean():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
