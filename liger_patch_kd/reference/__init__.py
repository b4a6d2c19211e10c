"""The distillation math, plainly, on materialised logits: the oracle every fused path is tested against.

Shapes: logits (..., V), labels (...). Rows are aligned: row i of the student is scored against row i of the
teacher and label i. Nothing here is optimised; it should read like the formulas in docs/loss-contract.md. By job:
core.py (the divergences, the hard term, reductions, the top-k teacher), estimators.py (on-policy per-token
estimators), teachers.py (sampled teacher tokens, several teachers). Every public name is here, as
`liger_patch_kd.reference.<name>`.
"""

from .core import *  # noqa: F403 (the oracle's public names, as one module)
from .estimators import *  # noqa: F403
from .teachers import *  # noqa: F403
