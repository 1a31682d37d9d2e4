"""What every paramserve process runs on, server or not: the gRPC server and its interceptors, the
one error boundary, TLS and tokens, channels, flags and TF_CONFIG, devices, CPU shares, memory
trimming, the metrics endpoint, atomic files, the zygote and the health probe.

May import: ``protocol``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.runtime.security import ClientTls, TlsConfig
    from paramserve.psserver.runtime.serving import GrpcService, RunningService
    from paramserve.psserver.runtime.tf_config import TfConfig
    from paramserve.psserver.runtime.zygote import Zygote

__all__ = [
    "ClientTls",
    "GrpcService",
    "RunningService",
    "TfConfig",
    "TlsConfig",
    "Zygote",
]

_HOMES = {
    "ClientTls": "security",
    "GrpcService": "serving",
    "RunningService": "serving",
    "TfConfig": "tf_config",
    "TlsConfig": "security",
    "Zygote": "zygote",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
