"""How lorabus's serving processes run, beneath everything else: the clock
every deadline is measured on, a cancellation Python 3.11 can lose, and the
event loop. Internal: not part of the public API (see ``lorabus``)."""
