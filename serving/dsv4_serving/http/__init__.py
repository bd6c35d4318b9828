"""HTTP pieces the engine's server and the gateway share: the error body, draining and
cancelling on client disconnect."""
