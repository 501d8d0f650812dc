"""What a kernel that gpuhub installs does not offer, though ipykernel does: its debugger, and (for
the replicated kernel) kernel subshells. Neither is advertised in ``kernel_info``, and their
requests are answered with the reason instead of being carried out.

- ipykernel's debugger starts debugpy, which listens on 127.0.0.1 without authentication: on a
  server that several users share, any of them could attach to it and run code as the kernel's user.
- A subshell's cell runs beside the main shell's; in a replicated kernel it ran on the one replica
  that had made the subshell, outside the Raft log, so only that replica had its variables.
"""

from __future__ import annotations

NO_DEBUGGER = ("this kernel has no debugger: debugpy would listen on a port that the server's other users "
               "could reach, and run code as you for whoever attached")
NO_SUBSHELLS = "gpuhub kernels run one cell at a time, on every replica in order: subshells are not supported"


class Refusals:
    """Mixed in before ``IPythonKernel``. ``refused`` names the ``supported_features`` taken away."""

    refused: tuple[str, ...] = ("debugger",)

    @property
    def kernel_info(self):
        info = super().kernel_info
        info["supported_features"] = [f for f in info.get("supported_features", []) if f not in self.refused]
        return info

    async def do_debug_request(self, msg):
        return {"type": "response", "request_seq": msg.get("seq"), "success": False, "command": msg.get("command"),
                "message": NO_DEBUGGER}

    async def create_subshell_request(self, socket, ident, parent) -> None:
        if "kernel subshells" not in self.refused:
            await super().create_subshell_request(socket, ident, parent)
            return
        self.session.send(socket, "create_subshell_reply", {"status": "error", "ename": "SubshellsUnsupported",
                                                            "evalue": NO_SUBSHELLS, "traceback": []}, parent, ident)
