"""A bound on what a stranger can make a replica's Raft port hold (pysyncobj 0.3.x).

pysyncobj encrypts and authenticates its messages (Fernet, with the password that
:func:`gpuhub.replication.log.raft_password` derives from the kernel's key), but it only checks a
message once the message is whole: a connection that announces a 2 GiB message and sends bytes
keeps them all in memory first (120 MiB sent cost a replica 166 MiB and 140 CPU-seconds). Anyone
on the site network can reach that port.

So until a connection has delivered one message that decrypted (the peer knows the kernel's
key), it may have at most :data:`UNAUTHENTICATED_BYTES` buffered; past that it is dropped. The
first message of pysyncobj's handshake is a 32-byte random key, about 200 bytes on the wire. After
that the peer is another replica of the kernel, and pysyncobj's own rules apply.

pysyncobj offers no hook for this, so :func:`install` wraps two private methods of its
``TcpConnection`` class (and ``disconnect``, which forgets the trust), once per process. It
refuses to start on a pysyncobj without them, and tests/integration/test_raft_log.py fails if a
new version reads past the bound anyway.
"""

from __future__ import annotations

import logging

from pysyncobj.tcp_connection import TcpConnection

log = logging.getLogger("gpuhub.replication")

UNAUTHENTICATED_BYTES = 4096
_READ = "_TcpConnection__processRead"
_PARSE = "_TcpConnection__processParseMessage"
_BUFFER = "_TcpConnection__readBuffer"
_TRUSTED = "_gpuhub_authenticated"


def install() -> None:
    """Bound unauthenticated reads on every pysyncobj connection of this process (idempotent)."""
    if getattr(TcpConnection, "_gpuhub_guarded", False):
        return
    read, parse = getattr(TcpConnection, _READ, None), getattr(TcpConnection, _PARSE, None)
    disconnect = TcpConnection.disconnect
    if read is None or parse is None:
        raise RuntimeError("this pysyncobj lacks the methods gpuhub guards (gpuhub/replication/raft_guard.py): "
                           "install the version requirements/runtime.txt pins")

    def guarded_read(self: TcpConnection) -> bool:
        more = read(self)
        if more and not getattr(self, _TRUSTED, False) and len(getattr(self, _BUFFER)) > UNAUTHENTICATED_BYTES:
            log.warning("dropped a Raft connection that sent over %d bytes before authenticating",
                        UNAUTHENTICATED_BYTES)
            self.disconnect()
            return False
        return more

    def guarded_parse(self: TcpConnection):
        message = parse(self)
        if message is not None:  # it decrypted: the peer holds the kernel's key
            setattr(self, _TRUSTED, True)
        return message

    def forgetting_disconnect(self: TcpConnection) -> None:
        setattr(self, _TRUSTED, False)  # an outgoing connection is reused: its next peer starts untrusted
        disconnect(self)

    setattr(TcpConnection, _READ, guarded_read)
    TcpConnection.disconnect = forgetting_disconnect
    setattr(TcpConnection, _PARSE, guarded_parse)
    TcpConnection._gpuhub_guarded = True
