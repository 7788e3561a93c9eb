"""The engine: its composition root (:mod:`.core`), between the facade and the layers it builds."""
