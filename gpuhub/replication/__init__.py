"""How a kernel's replicas stay equal (docs/architecture.md D4), one job per module:

- ``election``: the pure rule that picks a cell's executor;
- ``log``: the Raft log (pysyncobj): the replicated state machine and the typed group callers use;
- ``digest``: the one content hash (BLAKE3 tree) that names values everywhere;
- large values travel beside the log, named there by digest: ``blobstore`` (a replica's values in
  memory, and ``copy_into``, the copy that fills its buffers), ``blobserver`` (answers its peers),
  ``blobclient`` (push to / fetch from peers), ``blobwire`` (the authenticated, encrypted protocol
  between the two).
"""

import _socket
import socket as _socket_module

import pysyncobj.tcp_connection  # noqa: F401  (imports pysyncobj.win_inet_pton)

# pysyncobj.win_inet_pton replaces socket.inet_ntop on every OS with a Windows-only version, which
# fails on Linux: user code in a kernel (psutil.net_connections, say) would fail where a plain
# ipykernel works. Put the real one back, whichever pysyncobj import came first.
_socket_module.inet_ntop = _socket.inet_ntop
