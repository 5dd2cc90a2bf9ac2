"""Strata's benchmarks: user benches (``strata bench``, tier and MoE streaming, speculative
decoding), in-process probes of the serving engine, and kernel micro-benches (``kernels/``).

They sit above the executor and the planner and below the ``strata`` command; nothing in the
runtime imports them. Latest results are in ``benchmarks/results/`` (older ones in git history).
"""
