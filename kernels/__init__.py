"""fa3's device code: one module per rung, shared pieces under `common/`.

Installed as `fa3.kernels`. Kernels build layouts and launch; they never validate arguments or
allocate outputs (fa3.interface does), and take the configuration `config.py` chooses (plain
Python, which the host reads too).
"""
