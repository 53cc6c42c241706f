"""The ``lorabus`` command line, split by audience.

``main`` (the group, ``--version``, ``--log-level``, ``--identity``),
``serve`` (the agent and coordinator processes), ``orchestrate`` (update,
result, status, schema, adapter push and list), ``audit`` (tap, audit
verify, audit timeline), ``admin`` (auth init, provision, reset), ``demo``
and ``measure`` (the development tools: up, sim, bench, chaos); ``common``,
``extras``, ``headers`` and ``metrics_http`` hold what they share, and
:mod:`lorabus.service_flags` the serving processes' flags.
"""
