"""Adapters as objects: the content digest of an adapter directory, the
archive it travels as, the fleet's JetStream object store that holds it,
the bus paths that name it there, and the fetch that reads it back.
Internal: not part of the public API (see ``lorabus``)."""
