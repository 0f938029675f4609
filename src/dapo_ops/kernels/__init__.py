"""What runs on the device: the row kernels of the two-pass lm-head path and their dispatch.

Private stage (nothing here is public API): :mod:`dapo_ops.kernels.rows` holds the
per-row work around the cuBLAS products of :mod:`dapo_ops.logprobs._two_pass` (pass 1's
online log-sum-exp, pass 2's gradient of the logits) in two implementations, Triton
(:mod:`dapo_ops.kernels._triton_rows`) and ATen ops. It imports only ``_core``.
"""

__all__: list[str] = []
