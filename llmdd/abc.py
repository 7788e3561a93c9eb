"""Public transport seam: the protocols a transport plugin implements (re-export of ``_abc``)."""

from llmdd._seam.abc import CAPABILITY_BYTES as CAPABILITY_BYTES
from llmdd._seam.abc import CAPABILITY_KEY as CAPABILITY_KEY
from llmdd._seam.abc import Channel as Channel
from llmdd._seam.abc import Completion as Completion
from llmdd._seam.abc import Endpoint as Endpoint
from llmdd._seam.abc import Transport as Transport
from llmdd._seam.abc import TransportInfo as TransportInfo

__all__ = ["Transport", "TransportInfo", "Endpoint", "Channel", "Completion", "CAPABILITY_KEY", "CAPABILITY_BYTES"]
