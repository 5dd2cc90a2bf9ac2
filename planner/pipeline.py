"""The cost of a pipeline over several hosts (``Plan.cluster``): a decode step and time to first
token from the stages' one-host predictions and the links between them.

The schedule priced is the executor's (``strata.common.cluster``, ``executor.pipeline``): a
decode step is lock-step through the ring or cut into ``m`` micro-batches that flow
(``ClusterPrediction.micro_batches``, chosen below); a long prompt's chunks flow through the
stages one behind the other. A lock-step decode step of ``B`` sequences
(``costmodel.batch_size``): rank 0 embeds the B tokens and runs its blocks, sends the residual
rows ``[B, d]`` in its compute dtype to rank 1, which runs its blocks and sends on, ..., and the
last rank sends the rows back to rank 0, which runs the final norm, the head and sampling. No
stage works while another does, so the step is the sum of every part:

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

Micro-batched decode (``micro_batches`` = m > 1). The executor cuts a decode step of several
sequences into m micro-batches of about ``r = ceil(B / m)`` sequences, each its own pass: rank 0
runs micro-batch 1 and sends it on without waiting, then micro-batch 2 while rank 1 runs 1, and
so on; every micro-batch comes back. That is the flow shop of the prefill chunks above with m
equal jobs that all return: rank b's work on one is ``w_b = t_b(r) + latency_b + r
bytes_per_token_b / bandwidth_b``, with ``t_b(r)`` the cost model's decode step of stage b for
``r`` sequences (its weight reads and per-operation costs are paid again by every micro-batch's
pass; only the row-proportional compute shrinks) and the last rank's send the one back to rank
0, so (:func:`flow_shop` with ``v = w``)

    step_s(m) = sum_b w_b + (m - 1) max_b w_b

(``m = 1``: the lock-step sum). Approximated as the TTFT is: rank 0's head is inside its stage
time ``t_0(r)``, though the executor runs the heads after every micro-batch went out, so the
formula is high by up to ``(m - 1)`` heads where rank 0 binds; and each micro-batch is priced at
``r`` sequences, the largest (``np.array_split``'s parts differ by one). The planner prices m in
1, 2, 4, ... up to B (:func:`micro_batches`) and keeps the fastest, m = 1 unless a cut saves at
least ``MICRO_BATCH_GAIN`` of the step; m = 1 where rank 0 streams a unit (the executor does not
cut its steps). Its binding part is the largest term of one micro-batch (``t_b(r)`` or a
boundary's transfer of r rows), and a link's ``predicted_s`` its m transfers of r rows. The gain
is where ``t_b(r)`` is well below ``t_b(B)``: compute-bound stages (a CPU's decode, whose
quantized products cost per row, at a large batch), or experts, which each token reads apart
(a mixture-of-experts step reads about as many expert bytes cut as whole). A decode step bound
by weight reads and per-operation cost, as every planned anchor's is, gains nothing: ``t(B/m)
~ t(B)``, and ``m = 2`` over two equal stages gives ``3 t`` against lock-step's ``2 t``. Nothing
bounds m's bytes: the executor's last rank never waits on its sends (``executor.pipeline``, "Why
it cannot deadlock").

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

from collections.abc import Callable, Sequence

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

MICRO_BATCH_GAIN = 0.01
"""A micro-batched decode step is chosen only where it is at least this fraction faster than
the next fewer micro-batches (1% of the step: a cut adds a header, a message and a pass's Python
per micro-batch, which the cost model does not price)."""


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


def flow_shop(w: Sequence[float], v: Sequence[float], full: int) -> float:
    """Seconds for ``full`` equal jobs and a last one to pass through the ranks in order, each
    rank taking them one after the other and a job at rank b waiting for it at rank b - 1: the
    longest path through (rank, job) (module docstring), ``max over a of [sum_{b <= a} w_b +
    (full - 1) max_{b <= a} w_b + sum_{b >= a} v_b]``.

    Args:
        w: each rank's time for one of the equal jobs (with its send on), rank order.
        v: each rank's time for the last job, rank order.
        full: the equal jobs before the last, >= 1.
    """
    return max(sum(w[: a + 1]) + (full - 1) * max(w[: a + 1]) + sum(v[a:]) for a in range(len(w)))


def micro_batched_step(
    stage_s: Sequence[float], links: Sequence[LinkPlan], rows: int, m: int
) -> float:
    """A decode step cut into ``m`` micro-batches of ``rows`` sequences (module docstring),
    seconds: each rank's time for one (``stage_s``, rank order) and its send of its rows on (the
    last rank's back to rank 0) through the ranks as a flow shop; ``m = 1``: their sum, the
    lock-step step."""
    sends = [transfer_s(lk, rows) for lk in links]
    if m == 1:
        return sum([*stage_s, *sends])  # the stages, then the links, in turn
    w = [t + x for t, x in zip(stage_s, sends, strict=True)]
    return flow_shop(w, w, m - 1)  # every micro-batch alike, the last one too


def micro_batches(
    step_at: Callable[[int], Sequence[float]],
    links: Sequence[LinkPlan],
    batch: int,
    lockstep_s: float,
) -> tuple[int, int, float]:
    """The fastest cut of a ``batch``-sequence decode step (module docstring): ``(m, rows,
    step_s)`` over m = 1, 2, 4, ... up to ``batch``, each kept only where it is at least
    ``MICRO_BATCH_GAIN`` faster than the best fewer.

    Args:
        step_at: each stage's decode step for ``rows`` sequences (the cost model's), rank order.
        links: the boundaries (boundary j after stage j, the last back to stage 0).
        batch: B, the plan's decode batch.
        lockstep_s: the step whole (m = 1: :func:`micro_batched_step` of the stages at B).
    """
    best = (1, batch, lockstep_s)
    m = 2
    while m <= batch:
        rows = -(-batch // m)
        step = micro_batched_step(step_at(rows), links, rows, m)
        if step < (1 - MICRO_BATCH_GAIN) * best[2]:
            best = (m, rows, step)
        m *= 2
    return best


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
    return flow_shop(w, v, full)


def pipeline_prediction(
    stages: Sequence[StagePlan],
    links: Sequence[LinkPlan],
    request: Request,
    batch: BatchLimits,
    step_at: Callable[[int], Sequence[float]] | None = None,
) -> tuple[Prediction, ClusterPrediction, list[LinkPlan]]:
    """The pipeline's prediction from its stages' own predictions (module docstring).

    Args:
        stages: every stage with its one-host ``prediction`` (links excluded).
        links: the boundaries, in order (boundary j after stage j, the last back to stage 0);
            their ``predicted_s`` is recomputed here.
        request: the plan's request (the decode batch B, the prompt lengths).
        batch: the plan's batch limits (B's cap, the prefill chunk).
        step_at: each stage's decode step for a number of sequences (the cost model's on its
            host, rank order), to price micro-batched steps (:func:`micro_batches`); None:
            lock-step only.

    Raises:
        PlanError: a stage without a prediction (a hand-written cluster plan is judged first:
            ``planner.rescore.judge``).

    Returns:
        ``(prediction, cluster_prediction, links)``: the plan's top-level prediction (the terms
        summed over stages and links, TTFT as the module docstring prices it, the step the
        pipeline's, the bottleneck that of the slowest stage, binding the cluster's binding then
        that stage's own binding rows prefixed with its host), the cluster's (with its
        ``micro_batches``), and the links with their ``predicted_s`` (one decode step's
        transfers: m of ``ceil(B / m)`` rows).
    """
    preds: list[Prediction] = []
    for s in stages:
        if s.prediction is None:
            raise PlanError(f"stage {s.host} has no prediction; re-run strata plan --cluster")
        preds.append(s.prediction)
    b = batch_size(request, batch)
    each = [p.step_s for p in preds]
    m, rows, step = 1, b, micro_batched_step(each, links, b, 1)
    # Rank 0 streaming a unit runs every pass whole (executor.pipeline): no cut to price.
    if step_at is not None and links and stages[0].pool.slots == 0:
        m, rows, step = micro_batches(step_at, links, b, step)
        if m > 1:
            each = list(step_at(rows))
    links = [lk.model_copy(update={"predicted_s": m * transfer_s(lk, rows)}) for lk in links]
    # The binding part: the largest term of the step (lock-step), or of one micro-batch's.
    terms = [(f"host {s.host}", t) for s, t in zip(stages, each, strict=True)]
    terms += [(f"link {lk.hosts[0]}-{lk.hosts[1]}", transfer_s(lk, rows)) for lk in links]
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
        step_s=step, decode_tok_s=prediction.decode_tok_s, binding=binding, micro_batches=m
    )
    return prediction, cluster, links
