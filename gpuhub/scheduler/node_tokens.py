"""Each server's own token for what its agent asks of the scheduler (heartbeats, migrations).

The roles give every agent host a token of its own (``/etc/gpuhub/secrets/node.token``) and the
scheduler a copy of each in ``node_token_dir``, one ``<node>.token`` file per server. A node token
names its server: it is accepted only for that server's heartbeats and migration requests, never
for the scheduler's admin API, so root on one GPU server can neither act as the admin nor speak for
another server. A server added later needs no scheduler restart: an unknown token makes the
directory be read again, at most every few seconds (an unauthenticated caller cannot make it read
more often).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from gpuhub.platform.config import ConfigError, read_secret

log = logging.getLogger(__name__)

RELOAD_EVERY_S = 5.0
SUFFIX = ".token"


class NodeTokens:
    def __init__(self, directory: str, reload_every_s: float = RELOAD_EVERY_S) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(f"node_token_dir: {directory} is not a directory")
        self.reload_every_s = reload_every_s
        self._by_digest: dict[str, str] = {}  # sha256 of a token -> its node
        self._loaded_at = float("-inf")
        self.reload()

    def node_for(self, token: str | None) -> str | None:
        """The server ``token`` belongs to, or None."""
        if not token:
            return None
        digest = hashlib.sha256(token.encode()).hexdigest()
        node = self._by_digest.get(digest)
        if node is None and time.monotonic() - self._loaded_at >= self.reload_every_s:
            self.reload()
            node = self._by_digest.get(digest)
        return node

    def reload(self) -> None:
        self._loaded_at = time.monotonic()
        tokens: dict[str, str] = {}
        try:
            files = sorted(self.directory.glob(f"*{SUFFIX}"))
        except OSError as exc:
            log.error("cannot list node tokens in %s: %s", self.directory, exc)
            return
        for path in files:
            node = path.name.removesuffix(SUFFIX)
            try:
                tokens[hashlib.sha256(read_secret(path, f"node {node}").encode()).hexdigest()] = node
            except ConfigError as exc:
                log.error("node token of %s left out: %s", node, exc)
        self._by_digest = tokens
