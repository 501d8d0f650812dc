"""The kernel websocket of a user's Jupyter server, with Nagle's algorithm off.

Jupyter Server writes each kernel message to the websocket as it comes (busy, execute_input, the
reply, idle: several small writes per cell) and leaves Nagle's algorithm on. Its second small write
then waits until the peer acknowledges the first, and the peer (the hub's proxy, or a browser)
delays that acknowledgement by up to 40 ms hoping to send it with data: every cell's round trip,
through any kernel, took about 40 ms more than the kernel did. Browsers and the proxy already
disable Nagle on their side of a websocket; this does it on the server's.

The user's server uses it through ``--ServerApp.kernel_websocket_connection_class`` (the spawner,
gpuhub/hub/spawner.py).
"""

from __future__ import annotations

from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection


class NoDelayChannelsConnection(ZMQChannelsWebsocketConnection):
    """Jupyter Server's kernel websocket connection, whose socket sends each message at once."""

    def connect(self):
        self.websocket_handler.set_nodelay(True)  # the websocket is open: its stream exists
        return super().connect()
