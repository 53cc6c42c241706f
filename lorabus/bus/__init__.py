"""The link to NATS: connections that fail fast or wait for their bus, who a
connection is (``BusOptions``), and a rate limit for reports of junk input.
Internal, but for ``BusOptions``, which ``lorabus`` exports."""
