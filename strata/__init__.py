"""Strata: plan LLM inference across a memory hierarchy (GPU working set, RAM, NVMe), run it on MLX.

The package's layers, each a subpackage (installed from the repository's top-level folders):
``strata.common`` (the contract: schemas, errors, GGUF reading, YAML I/O; no MLX) <
``strata.planner`` (describe, cost model, ILP, explain, diff) and ``strata.executor`` (MLX
kernels up to the HTTP server), with ``strata.cli`` (the ``strata`` command) on top. The layers
are checked by import-linter (``.importlinter``).
"""

__version__ = "0.1.0"
