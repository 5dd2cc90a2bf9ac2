"""The contract between planner and executor, with no MLX import: the plan, profile and model
description schemas, errors, GGUF reading, the model catalog, YAML I/O, sizes, atomic writes and
the GGUF quant types' MLX form."""
