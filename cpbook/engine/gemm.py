"""The engine's linear layers: each weight prepared once for the device's GEMM.

vLLM v0.34.0 on a CPU does not call ``torch.nn.functional.linear`` with the checkpoint's
weight: at load it hands every unquantized linear weight to oneDNN once
(``cpu_ops.create_onednn_mm(weight.t(), 32)``, which reorders it into the layout oneDNN's
kernel reads, then ``onednn_mm`` per call; ``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``).  The reordered weight saves the kernel from packing
the weight again in every call, which at decode-sized batches is a large part of the GEMM.

:class:`PackedLinear` does the same with PyTorch's own oneDNN reorder
(``torch.ops.mkldnn._reorder_linear_weight``, applied by ``_linear_pointwise``) for float32
weights of at least :data:`ONEDNN_MIN_WEIGHT_BYTES` on a CPU built with oneDNN; every other
case (float64, the book's exact runs; a GPU; a build without oneDNN) keeps the plain
``x @ w``, so float64 results are unchanged bit for bit.  oneDNN sums in its own order:
float32 outputs agree with ``x @ w`` to rounding, not bit for bit.

Small weights keep ``x @ w`` for the same reason vLLM sends weights of at most 1 MiB to a
kernel with less dispatch work (``check_cpu_sgl_kernel``, same file; bf16/fp16 on AMX CPUs):
on a small weight a oneDNN call spends up to 17 microseconds more than ``x @ w``, about what
the whole product takes.  Measured here (one thread, float32),
``x @ w`` wins below 128 Ki weights (a ``[256, 256]`` weight at 8 rows: 18 µs against 25),
the two tie at 128 Ki, and the reorder wins above (a ``[256, 1024]`` weight at 8 rows:
59 µs against 90; ``[1024, 2816]``: 0.93 ms against 1.89).
"""

from __future__ import annotations

import torch

__all__ = ["PackedLinear"]

#: the batch size oneDNN's reorder is tuned for (vLLM passes 32 too); any batch size runs
ONEDNN_BATCH_HINT = 32

#: the smallest weight reordered for oneDNN (128 Ki float32 values); smaller ones keep ``x @ w``
ONEDNN_MIN_WEIGHT_BYTES = 512 * 1024


class PackedLinear:
    """``x [..., K] -> x @ weight (+ bias) [..., N]`` for a weight ``[K, N]`` (and a bias
    ``[N]``), prepared once: oneDNN-reordered for a float32 weight of at least
    :data:`ONEDNN_MIN_WEIGHT_BYTES` on a CPU with oneDNN, else kept."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.onednn = (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.numel() * weight.element_size() >= ONEDNN_MIN_WEIGHT_BYTES
            and torch.backends.mkldnn.is_available()
        )
        if self.onednn:  # oneDNN takes the weight as [N, K]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.t().contiguous(), ONEDNN_BATCH_HINT
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)
