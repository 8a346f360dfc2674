"""The cluster state every Conductor replica keeps: who the workers are, their leases and
loads (``registry``), which blocks each holds (``kvstore.block_index``), and the ordered log
of changes that feeds them (``log``: in-process for one Conductor, a Redis stream shared by
replicas). Below ``conductor/`` and ``runtime/``: it imports neither."""
