"""Built-in codecs; importing this package registers them."""

from kvjax.codecs.bf16 import Bf16Codec, F32Codec
from kvjax.codecs.fp8 import Fp8Codec
from kvjax.codecs.hqmq import HqmqCodec
from kvjax.codecs.hyperquant import HyperQuantCodec
from kvjax.codecs.intn import IntCodec
from kvjax.codecs.kivi import KiviCodec
from kvjax.codecs.octopus import OctopusCodec
from kvjax.codecs.outliers import MedOutlierCodec
from kvjax.codecs.polarquant import PolarQuantCodec
from kvjax.codecs.saw import SawCodec
from kvjax.codecs.turboquant import TurboQuantCodec

__all__ = [
    "Bf16Codec", "F32Codec", "Fp8Codec", "HqmqCodec", "HyperQuantCodec", "IntCodec", "KiviCodec",
    "MedOutlierCodec", "OctopusCodec", "PolarQuantCodec", "SawCodec", "TurboQuantCodec",
]
