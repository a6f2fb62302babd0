"""fa3's device code: one module per rung, shared pieces under `common/`.

Installed as `fa3.kernels`. Kernels build layouts and launch; they never validate arguments,
allocate outputs or choose configurations (fa3.interface and fa3.registry do).
"""
