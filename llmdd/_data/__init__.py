"""The data plane: planning block transfers, moving them over a link's channel, serving peers' requests."""
