"""Adapters as objects: the content digest of an adapter directory, the
archive it travels as, and the fleet's JetStream object store that holds
it. Internal: not part of the public API (see ``lorabus``)."""
