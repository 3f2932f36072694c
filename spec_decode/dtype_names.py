"""The short dtype names the project spells (``"fp32"``, ``"bf16"``, ``"fp16"``), without importing torch.

``spec_decode.dtypes`` maps them to torch dtypes; the pytest plugin, which loads in every pytest run
and must not import torch, and the bench's options read the names from here.
"""

DTYPE_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16")
