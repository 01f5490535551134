"""An Atlas A2 (Ascend 910B) time model: the estimated device time of counted ops, from public constants only.

Every figure this module gives is an **estimate**, never a measurement: there is no Ascend device here. Per op
(`accounting.OpRecord`):

    device time = max(bytes / HBM bandwidth, matmul FLOPs / cube throughput, elements written / vector throughput)

a roofline per op (the op streams its bytes from HBM once, its matrix products run on the cube units at the
measured large-matmul rate, its elementwise work on the vector units); a step runs its ops one after the other on
one stream. The host issues every op (`HOST_PER_OP`) while the device runs earlier ones: host dispatch and device
execution are asynchronous on Ascend, and a step is host-bound when dispatch takes longer than execution
(`HOST_BOUND` below). So a step's estimated time is max(sum of device times, ops x host cost per op).

The constants (`CONSTANTS`) come from public specifications or measurements, each with its source; none is fitted to
the published figures the model is checked against (`step_validation.validation_rows`). What the model leaves out:
caches (an op whose inputs sit in the 192 MB L2 reads less from HBM), matmul efficiency below the 4096-cube rate at
small or thin shapes, kernel tail effects, communication (the published figures ran on 8 devices), and the host's own
Python work beyond its per-op cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .accounting import OpRecord


@dataclass(frozen=True)
class Constant:
    """A constant of the model: its value, unit, where it comes from (a URL or repo@commit:path) and what it is."""

    value: float
    unit: str
    source: str
    note: str


HBM_BANDWIDTH = Constant(
    1.2e12,
    "bytes/s",
    "https://www.oryoy.com/news/910b-suan-li-shi-duo-shao-jie-mi-hua-wei-sheng-teng-910b-xin-pian-de-xing-neng-can-shu-yu-shi-ji-sua.html",
    "Ascend 910B HBM2e, 1.2 TB/s (stated as theoretical). Public figures for the 910B disagree (400 GB/s to 1.2 TB/s "
    "in https://blog.youkuaiyun.com/sunyuhua_keyboard/article/details/155732470, by version); the highest published "
    "one is taken, so memory-bound times are lower bounds.",
)
CUBE_BF16 = Constant(
    315.36e12,
    "FLOP/s",
    "https://github.com/zzc0721/torch-performance-test-data/issues/109",
    "Measured torch matmul throughput on an Ascend910B2, bfloat16, 4096 x 4096 x 4096 (the same source: 301 TFLOP/s "
    "at 8192, 248 at 2048, 100 at 1024); used for every bfloat16 and float16 matrix product.",
)
CUBE_FP32 = Constant(
    84.53e12,
    "FLOP/s",
    "https://github.com/zzc0721/torch-performance-test-data/issues/109",
    "Measured torch matmul throughput on an Ascend910B2, float32, 4096 x 4096 x 4096; used for float32 products.",
)
VECTOR = Constant(
    3.39e12,
    "elements/s",
    "https://doi.org/10.1007/s42514-024-00187-x",
    "AIBench (Xiao and Wang, CCF THPC 2024): 3390 GFLOP/s float16 measured from the vector units of an Ascend 910 "
    "(the 910B has more vector cores: a conservative figure); one vector operation per element written.",
)
HOST_PER_OP = Constant(
    32.5e-6,
    "s",
    "https://github.com/hw-native-sys/pypto/issues/1919",
    "torch_npu on an Ascend 910 (910_9362), CANN 8.5: 100 iterations of (x.npu() + y.npu()).cpu() on 128 x 128 "
    "tensors took 0.013 s, 130 us for 4 device ops (two copies in, the add, one copy out, synchronised): 32.5 us per "
    "op, an upper bound of the host's cost per op (it includes the synchronisation).",
)
HOST_BOUND = Constant(
    1.0,
    "",
    "https://www.hiascend.com/document/detail/zh/mindstudio/81RC1/practicalcases/GeneralPerformanceIssue/toolsample6_052.html",
    "Ascend's performance guide: with torch_npu, host dispatch and device execution run asynchronously; when "
    "dispatch takes longer than execution the device waits (Host Bound). Hence step time = max(device, host).",
)
CONSTANTS: dict[str, Constant] = {
    "HBM bandwidth": HBM_BANDWIDTH,
    "cube, bfloat16/float16": CUBE_BF16,
    "cube, float32": CUBE_FP32,
    "vector": VECTOR,
    "host cost per op": HOST_PER_OP,
    "host and device overlap": HOST_BOUND,
}


def op_seconds(record: OpRecord, float32: bool = False) -> float:
    """The estimated device time of one op (see the module doc); `float32`: its matrix product runs in float32."""
    cube = (CUBE_FP32 if float32 else CUBE_BF16).value
    return max(
        (record.reads + record.writes) / HBM_BANDWIDTH.value,
        record.flops / cube,
        record.elements / VECTOR.value,
    )


def device_seconds(records: Iterable[OpRecord]) -> float:
    """The estimated device time of ops run one after the other."""
    return sum(op_seconds(r, _float32_matmul(r)) for r in records)


def _float32_matmul(record: OpRecord) -> bool:
    """Whether a matrix product runs at the float32 rate: float32 operands do, 16-bit ones whatever they write.

    aclnnAddmm's 16-bit inputs with a float32 out accumulate in float32 on the 16-bit cube path."""
    return bool(record.flops) and record.operand_bytes >= 4


def step_seconds(records: Iterable[OpRecord]) -> float:
    """The estimated time of a step: the device's time or the host's (ops x its cost per op), whichever is longer."""
    records = list(records)
    return max(device_seconds(records), len(records) * HOST_PER_OP.value)


@dataclass(frozen=True)
class Estimate:
    """A step's estimated seconds, split: the device's (by the roofline), the host's (ops x its cost per op)."""

    device: float
    host: float

    @property
    def seconds(self) -> float:
        return max(self.device, self.host)


def estimate(records: Iterable[OpRecord]) -> Estimate:
    """The device's and the host's estimated seconds for these ops."""
    records = list(records)
    return Estimate(device_seconds(records), len(records) * HOST_PER_OP.value)
