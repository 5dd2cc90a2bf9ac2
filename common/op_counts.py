"""How many MLX graph operations the executor's forward pass builds per unit: a fact of the
executor that the planner's cost model prices (each operation pays the profile's
``gpu.op_overhead_s``), so it lives in the contract layer."""

OPS_PER_UNIT = {
    "attention": 21,
    "ffn": 8,
    "expert": 10,
    "router": 3,
    "embedding": 6,
    "output": 4,
    "norm": 1,
    "other": 1,
}
"""MLX graph operations one decode step builds per unit, by the unit's role, counted in
``executor/models/llama.py`` (each pays ``gpu.op_overhead_s``, which ``strata.executor.profile``
measures on a decode step built from the same attention and FFN ops): attention 21 = RMSNorm,
Q/K/V projections (3), their reshapes (3) and transposes (3), 2 RoPE, 2 KV-cache writes and 2
reads of the filled part, SDPA, the output's transpose and reshape, the O projection and the
residual add; FFN 8 = RMSNorm, gate/up/down projections, sigmoid, two products, residual add;
embedding 6 = the row gather of the quantized table's weight, scales and biases,
dequantization, the cast and the batch axis; output 4 = the last-token slice, the final RMSNorm,
the head projection and the float32 cast."""

OVERLAPPED_BACKENDS = ("cuda",)
"""Backends on which the executor overlaps a decode step's host work with the device's: it
schedules the blocks with ``mx.async_eval`` as they are built (every
``RuntimeConfig.async_eval_blocks`` blocks) and launches each greedy step before reading the one
before (pipelined steps). The cost model then takes a step's compute as the larger of its host
and device terms (``planner.costmodel.step_compute_s``), and the profile measures the host's
per-op cost with steps pipelined (``executor.profile.OpOverheadProbe``)."""
