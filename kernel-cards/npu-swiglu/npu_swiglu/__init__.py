"""npu-swiglu: gated MLPs on Huawei Ascend NPUs, SiLU through torch_npu.npu_swiglu, GELU-tanh through npu_geglu.

Per MLP form, `<op>` (fused where it can be), `<op>_eager` (the exact fallback) and
`<op>_unavailable_reason` (why the fallback runs): `swiglu_mlp` for split gate_proj/up_proj,
`swiglu_gate_up_mlp` for one gate_up_proj, `geglu_mlp` for split projections with a GELU-tanh
gate (Gemma). No weight is ever copied or re-laid out.
"""

from . import layers
from ._build import VARIANT
from .geglu import geglu_mlp, geglu_mlp_eager, geglu_mlp_unavailable_reason
from .swiglu import (
    swiglu_gate_up_mlp,
    swiglu_gate_up_mlp_eager,
    swiglu_gate_up_mlp_unavailable_reason,
    swiglu_mlp,
    swiglu_mlp_eager,
    swiglu_mlp_unavailable_reason,
)

__all__ = [
    "VARIANT",
    "geglu_mlp",
    "geglu_mlp_eager",
    "geglu_mlp_unavailable_reason",
    "layers",
    "swiglu_gate_up_mlp",
    "swiglu_gate_up_mlp_eager",
    "swiglu_gate_up_mlp_unavailable_reason",
    "swiglu_mlp",
    "swiglu_mlp_eager",
    "swiglu_mlp_unavailable_reason",
]
