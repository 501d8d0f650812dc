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
import random as _random
import socket as _socket_module

import pysyncobj.dns_resolver
import pysyncobj.syncobj
import pysyncobj.tcp_connection  # (imports pysyncobj.win_inet_pton)
import pysyncobj.transport

# pysyncobj.win_inet_pton replaces socket.inet_ntop on every OS with a Windows-only version, which
# fails on Linux: user code in a kernel (psutil.net_connections, say) would fail where a plain
# ipykernel works. Put the real one back, whichever pysyncobj import came first.
_socket_module.inet_ntop = _socket.inet_ntop

# pysyncobj draws its election timeouts from the `random` module's own generator, from its thread,
# at each message from the leader: in a kernel that is the generator a notebook seeds
# (`random.seed(0)`), and the numbers a cell drew after a pause were not a plain kernel's. It
# draws from a generator of its own instead.
_raft_random = _random.Random()
for _module in (pysyncobj.syncobj, pysyncobj.transport, pysyncobj.dns_resolver):
    _module.random = _raft_random
