"""The tokens between the scheduler and each server: the server's own token for what its agent
asks of the scheduler (heartbeats, migrations; ``NodeTokens``), and the token the scheduler presents
to that server's agent (``AgentTokens``).

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
import re
import time
from pathlib import Path

from gpuhub.platform.config import ConfigError, read_secret
from gpuhub.scheduler.node_info import NODE_NAME_PATTERN

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


class AgentTokens:
    """The token the scheduler presents to each server's agent.

    The roles give every agent its own token (the agent keeps only its hash) and the scheduler a
    copy of each in ``directory``, ``<node>.token``: root on one server sees its own agent's token
    in the scheduler's requests, which opens no other agent. The file is read at each call (they
    are few: placements, stops, reconciles), so a new server or a rotated token needs no restart.
    Without a directory every agent gets ``shared`` (one token for all: development clusters).
    """

    def __init__(self, shared: str = "", directory: str = "") -> None:
        if not shared and not directory:
            raise ConfigError("agent tokens: neither agent_token_file nor agent_token_dir is set")
        self.shared = shared
        self.directory = Path(directory) if directory else None
        if self.directory is not None and not self.directory.is_dir():
            raise ConfigError(f"agent_token_dir: {directory} is not a directory")

    def for_node(self, node: str) -> str:
        """The token for ``node``'s agent; ConfigError when there is none to present."""
        if self.directory is None:
            return self.shared
        if not re.fullmatch(NODE_NAME_PATTERN, node):
            raise ConfigError(f"no agent token for {node!r}: not a server name")
        return read_secret(self.directory / f"{node}{SUFFIX}", f"agent of {node}")
