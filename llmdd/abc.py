"""Public transport seam: the protocols a transport plugin implements (re-export of ``_abc``)."""

from ._abc import CAPABILITY_BYTES as CAPABILITY_BYTES
from ._abc import CAPABILITY_KEY as CAPABILITY_KEY
from ._abc import Channel as Channel
from ._abc import Completion as Completion
from ._abc import Endpoint as Endpoint
from ._abc import Transport as Transport
from ._abc import TransportInfo as TransportInfo

__all__ = ["Transport", "TransportInfo", "Endpoint", "Channel", "Completion", "CAPABILITY_KEY", "CAPABILITY_BYTES"]
