"""The cost of a pipeline over several hosts (``Plan.cluster``): a decode step and time to first
token from the stages' one-host predictions and the links between them.

The schedule priced is the executor's (``strata.common.cluster``, ``executor.pipeline``): a
decode step is lock-step through the ring, one micro-batch (``ClusterPrediction.micro_batches``
= 1); a long prompt's chunks flow through the stages one behind the other. A decode step of
``B`` sequences (``costmodel.batch_size``): rank 0 embeds the B tokens and runs its blocks, sends
the residual rows ``[B, d]`` in its compute dtype to rank 1, which runs its blocks and sends on,
..., and the last rank sends the rows back to rank 0, which runs the final norm, the head and
sampling. No stage works while another does, so the step is the sum of every part:

    step_s = sum_i stage_step_i + sum_j (latency_j + B * bytes_per_token_j / bandwidth_j)

with ``stage_step_i`` the one-host prediction of stage i's own units on its host
(``costmodel.score``: its compute, copies and reads; the head's cost is in stage 0's), boundary j
carrying stage j's output to stage j + 1 (the last boundary back to stage 0), and
``bytes_per_token = embedding_length x compute-dtype bytes`` of the sending stage. The binding
part (``ClusterPrediction.binding``) is the largest term of the step: a stage (``host NAME``) or a
boundary's transfer (``link A-B``).

Prefill (``ttft_s``). A prompt of ``P`` tokens runs as ``F`` full chunks of ``c`` tokens and a
last one of ``l`` (``prefill_chunks``). Every chunk crosses the boundaries as ``[r, d]`` rows,
but the chunks before the last do not come back to rank 0 (nobody reads their output): rank 0
runs chunk k + 1 while rank 1 runs chunk k (the executor's flowing passes). Rank ``b``'s work on
a chunk is its stage's time for it plus its send on the boundary after it (a send blocks until
the link takes the rows): ``w_b`` for a full chunk (``prefill_chunk_s``; the last rank sends
nothing back), ``v_b`` for the last (``TTFT_b(P) - F prefill_chunk_s``, the cost model's own
split, and the last rank's send back to rank 0). Each rank runs the chunks in order and a chunk
at rank b waits for it at rank b - 1: a flow shop, whose time is its longest path through (rank,
chunk). With the full chunks alike, the path that reaches the last chunk at rank ``a`` runs the
first chunk through ranks 0 .. a, the other full chunks at the slowest of those, and the last
chunk through ranks a .. end:

    TTFT(P) = max over a of [ sum_{b <= a} w_b + (F - 1) max_{b <= a} w_b + sum_{b >= a} v_b ]

(with a last chunk as long as the others it is ``max_b (fill_b + T_b + drain_b)``: rank b's whole
share ``T_b``, the first chunk through the ranks before it, the last through those after). One
chunk (``F = 0``) is lock-step, ``sum_i TTFT_i(P) + sum_j (latency_j + l bytes_per_token_j /
bandwidth_j)``. Where rank 0 streams a unit from NVMe (``StagePlan.pool``) its passes run the head
for the stream's schedule and come back, so each chunk waits for the one before: ``TTFT(P) =
sum_i TTFT_i(P) + sum over P's chunks of sum_j (latency_j + r bytes_per_token_j /
bandwidth_j)``. Approximated: rank 0's head of the last chunk, which runs once its rows come
back, is inside its stage's chunk time (the cost model does not price it apart), so the paths
through later ranks leave it out (at most one chunk's head low); and a transfer is counted on its
sender only, though a blocking send holds the receiver too, so where a receiving rank binds the
TTFT is low by up to one transfer per chunk (the DeepSeek-V3 plan's: 1.5 ms a chunk).

What lock-step decode leaves on the table, and when: with ``m`` micro-batches of ``B/m``
sequences in flight every stage works at once, but each micro-batch's pass reads the stage's
weights and pays its operations again, so a stage's time per micro-batch is ``t_i(B/m)``, and
the throughput ``(B/m) / max_i t_i(B/m)`` beats lock-step's ``B / sum_i t_i(B)`` only where
``t_i(B/m)`` is well below ``t_i(B)``: compute-bound passes (the prefill chunks above, large
decode batches). A decode step bound by weight reads and per-operation cost, as every planned
anchor's is, gains nothing from micro-batches (``m = S`` equal stages: ``B / (S t)`` either
way). The executor does not cut decode steps into micro-batches, so the planner prices ``m = 1``.

Tensor parallelism, for comparison (not planned): splitting every block's matrices over ``n``
hosts makes each host read ``1/n`` of the weights per token, so the device part of a
bandwidth-bound decode step falls to about ``1/n`` (the host's per-operation cost does not: every
host builds every block's operations) — but every block then needs two all-reduces of the
``[B, d]`` residual (after attention's output projection and after the FFN's down projection):
``2 L`` collective operations per step, each costing at least a link latency and ``2 (n-1)/n B d``
dtype bytes per host (ring all-reduce), against the pipeline's ``n`` transfers of ``B d`` bytes.
It wins when ``(1 - 1/n) device_s > 2 L (all-reduce latency + 2 (n-1)/n B d bytes / bandwidth) -
n (latency + B d bytes / bandwidth)``: a latency of microseconds (RDMA: JACCL over Thunderbolt 5,
NVLink) and a device term of tens of milliseconds; over TCP (hundreds of microseconds per
message) the ``2 L`` latencies of a 60-block model cost tens of milliseconds, which only very slow
steps repay. docs/clusters.md works the numbers of the DeepSeek-V3 anchor.
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.common.errors import PlanError
from strata.common.schemas import (
    BatchLimits,
    ClusterPrediction,
    LinkPlan,
    ModelCosts,
    Prediction,
    Request,
    StagePlan,
)
from strata.planner.costmodel import DTYPE_BYTES, batch_size, prefill_chunks


def bytes_per_token(costs: ModelCosts, stage: StagePlan) -> int:
    """Activation bytes one token sends over the boundary after ``stage``: its residual row,
    ``embedding_length x`` the stage's compute-dtype bytes."""
    return costs.architecture.embedding_length * DTYPE_BYTES[stage.runtime.compute_dtype]


def transfer_s(link: LinkPlan, rows: int) -> float:
    """Seconds to send ``rows`` residual rows over ``link``: ``latency + rows x bytes_per_token
    / bandwidth`` (one message; ``ClusterLink``)."""
    return link.latency_s.value + rows * link.bytes_per_token / link.bandwidth_bytes_s.value


def _ttft_links(links: Sequence[LinkPlan], prompt: int, chunk: int) -> float:
    """The boundary transfers of a ``prompt``-token prefill in chunks of ``chunk`` tokens."""
    full, last = prefill_chunks(prompt, chunk)
    return sum(full * transfer_s(lk, chunk) + transfer_s(lk, last) for lk in links)


def flowing_ttft(
    chunk_s: Sequence[float],
    ttft_s: Sequence[float],
    links: Sequence[LinkPlan],
    prompt: int,
    chunk: int,
) -> float:
    """Time to first token of a ``prompt``-token prompt whose chunks before the last flow
    through the ranks (module docstring), seconds.

    Args:
        chunk_s: each stage's time for one full chunk of ``chunk`` tokens (``prefill_chunk_s``),
            in rank order.
        ttft_s: each stage's one-host TTFT of this prompt.
        links: the boundaries (boundary j after stage j, the last back to stage 0).
        prompt: the prompt's tokens.
        chunk: the prefill chunk, tokens.
    """
    full, last = prefill_chunks(prompt, chunk)
    n = len(chunk_s)
    if full == 0 or n == 1:  # one chunk, or one host: lock-step
        return sum(ttft_s) + _ttft_links(links, prompt, chunk)
    # w: a rank's full chunk (its send on; the last rank sends none back), v: its last chunk.
    w = [c + (transfer_s(links[b], chunk) if b < n - 1 else 0.0) for b, c in enumerate(chunk_s)]
    v = [
        max(0.0, t - full * c) + transfer_s(lk, last)
        for t, c, lk in zip(ttft_s, chunk_s, links, strict=True)
    ]
    return max(sum(w[: a + 1]) + (full - 1) * max(w[: a + 1]) + sum(v[a:]) for a in range(n))


def pipeline_prediction(
    stages: Sequence[StagePlan],
    links: Sequence[LinkPlan],
    request: Request,
    batch: BatchLimits,
) -> tuple[Prediction, ClusterPrediction, list[LinkPlan]]:
    """The pipeline's prediction from its stages' own predictions (module docstring).

    Args:
        stages: every stage with its one-host ``prediction`` (links excluded).
        links: the boundaries, in order (boundary j after stage j, the last back to stage 0);
            their ``predicted_s`` is recomputed here.
        request: the plan's request (the decode batch B, the prompt lengths).
        batch: the plan's batch limits (B's cap, the prefill chunk).

    Raises:
        PlanError: a stage without a prediction (a hand-written cluster plan is judged first:
            ``planner.rescore.judge``).

    Returns:
        ``(prediction, cluster_prediction, links)``: the plan's top-level prediction (the terms
        summed over stages and links, TTFT as the module docstring prices it, the step the
        pipeline's, the bottleneck that of the slowest stage, binding the cluster's binding then
        that stage's own binding rows prefixed with its host), the cluster's, and the links with
        their ``predicted_s`` (one decode step's transfer).
    """
    preds: list[Prediction] = []
    for s in stages:
        if s.prediction is None:
            raise PlanError(f"stage {s.host} has no prediction; re-run strata plan --cluster")
        preds.append(s.prediction)
    b = batch_size(request, batch)
    links = [lk.model_copy(update={"predicted_s": transfer_s(lk, b)}) for lk in links]
    terms = [(f"host {s.host}", p.step_s) for s, p in zip(stages, preds, strict=True)]
    terms += [(f"link {lk.hosts[0]}-{lk.hosts[1]}", lk.predicted_s) for lk in links]
    step = sum(v for _, v in terms)
    binding = max(terms, key=lambda kv: kv[1])[0]  # ties: the first (stages in rank order)
    slowest = max(range(len(stages)), key=lambda i: preds[i].step_s)
    own = [f"{stages[slowest].host}: {r}" for r in preds[slowest].binding]
    chunk = max(1, batch.prefill_chunk)
    chunks = [p.prefill_chunk_s for p in preds]
    full_s = [c for c in chunks if c is not None]
    # Rank 0 streaming a unit computes every pass's head and waits for it (executor.pipeline).
    flows = stages[0].pool.slots == 0 and len(full_s) == len(chunks)
    ttft = []
    if all(len(p.ttft_s) == len(request.prompt_tokens) for p in preds):
        for k, prompt in enumerate(request.prompt_tokens):
            each = [p.ttft_s[k] for p in preds]
            if flows:
                ttft.append(flowing_ttft(full_s, each, links, prompt, chunk))
            else:
                ttft.append(sum(each) + _ttft_links(links, prompt, chunk))
    prefill = (
        sum(chunks) + sum(transfer_s(lk, chunk) for lk in links)
        if all(c is not None for c in chunks)
        else None
    )
    hits = [p.expert_hit_rate for p in preds if p.expert_hit_rate is not None]
    prediction = Prediction(
        compute_s=sum(p.compute_s for p in preds),
        host_copy_s=sum(p.host_copy_s for p in preds),
        disk_s=sum(p.disk_s for p in preds),
        io_stall_s=sum(p.io_stall_s for p in preds),
        # The stages' hit rates are of different experts; their mean is a summary, not a rate.
        expert_hit_rate=round(sum(hits) / len(hits), 6) if hits else None,
        step_s=step,
        bottleneck=preds[slowest].bottleneck,
        decode_tok_s=b / step if step > 0 else 0.0,
        binding=[binding, *own],
        prefill_chunk_s=prefill,
        ttft_s=ttft,
    )
    cluster = ClusterPrediction(
        step_s=step, decode_tok_s=prediction.decode_tok_s, binding=binding, micro_batches=1
    )
    return prediction, cluster, links
