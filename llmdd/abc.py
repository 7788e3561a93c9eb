"""Public transport seam: the protocols a transport plugin implements and the descriptors they exchange."""

from llmdd._seam.abc import CAPABILITY_BYTES as CAPABILITY_BYTES
from llmdd._seam.abc import MAX_PAYLOAD_BYTES as MAX_PAYLOAD_BYTES
from llmdd._seam.abc import Channel as Channel
from llmdd._seam.abc import Completion as Completion
from llmdd._seam.abc import Endpoint as Endpoint
from llmdd._seam.abc import PreparedTransfer as PreparedTransfer
from llmdd._seam.abc import EndpointDescriptor as EndpointDescriptor
from llmdd._seam.abc import RegionDescriptor as RegionDescriptor
from llmdd._seam.abc import Transport as Transport
from llmdd._seam.abc import TransportInfo as TransportInfo

__all__ = ["Transport", "TransportInfo", "Endpoint", "Channel", "Completion", "EndpointDescriptor",
           "RegionDescriptor", "PreparedTransfer", "MAX_PAYLOAD_BYTES", "CAPABILITY_BYTES"]
