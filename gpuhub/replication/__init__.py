"""How a kernel's replicas stay equal (docs/architecture.md D4), one job per module:

- ``election``: the pure rule that picks a cell's executor;
- ``log``: the Raft log (pysyncobj): the replicated state machine and the typed group callers use;
- ``digest``: the one content hash (BLAKE3 tree) that names values everywhere;
- large values travel beside the log, named there by digest: ``blobstore`` (a replica's values in
  memory, and ``copy_into``, the copy that fills its buffers), ``blobserver`` (answers its peers),
  ``blobclient`` (push to / fetch from peers), ``blobwire`` (the authenticated protocol between
  the two).
"""
