"""Reading traces back: a request's trace from the backend's query API, drawn as a waterfall
(emitting spans is ``entrypoints.tracing`` and ``gateway.tracing``)."""
