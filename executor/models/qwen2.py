"""Architecture ``qwen2`` (Qwen2, Qwen2.5) as llama.cpp runs it (``src/models/qwen2.cpp``).

The llama decoder (``executor/models/llama.py``) with two differences: Q, K and V projections
have biases (required), and RoPE rotates the two halves of each head (llama.cpp's
``LLAMA_ROPE_TYPE_NEOX``, MLX's ``traditional=False``). llama.cpp ignores
``qwen2.attention.sliding_window`` (every block attends globally), and so does Strata.
"""

from __future__ import annotations

from strata.executor.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    """A qwen2-architecture model over a weight store (see :class:`LlamaModel`)."""

    rope_traditional = False
    rope_freqs_tensor = False
