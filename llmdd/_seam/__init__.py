"""The transport seam: the protocols a transport implements and the helpers transports share."""
