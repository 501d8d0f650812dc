"""What a kernel that gpuhub installs does not offer, though ipykernel does: its debugger, and (for
the replicated kernel) kernel subshells. Neither is advertised in ``kernel_info``, and their
requests are answered with the reason instead of being carried out.

- ipykernel's debugger starts debugpy, which listens on 127.0.0.1 without authentication: on a
  server that several users share, any of them could attach to it and run code as the kernel's user.
- A subshell's cell runs beside the main shell's; in a replicated kernel it ran on the one replica
  that had made the subshell, outside the Raft log, so only that replica had its variables.

And in an installed release, ``%pip install`` / ``uninstall`` say why they change nothing instead of
running pip: the kernel runs from a release venv that only the admin changes (root's, the same on
every server), so pip could only fail, after its retries, with its own words (a replica's change
would reach one server at most anyway). ``%pip list``, ``show`` and the rest run as in IPython, and
so does all of ``%pip`` in a venv of one's own (``pip install gpuhub``, a development checkout).
"""

from __future__ import annotations

import sys

from gpuhub.platform.releases import release_name

NO_DEBUGGER = ("this kernel has no debugger: debugpy would listen on a port that the server's other users "
               "could reach, and run code as you for whoever attached")
NO_SUBSHELLS = "gpuhub kernels run one cell at a time, on every replica in order: subshells are not supported"


NO_PIP_CHANGES = ("[gpuhub] %pip {action} changes nothing here: this kernel's Python environment is the one "
                  "your admin installs on every server. Ask your admin to add the package for everyone "
                  "(it is then in every new kernel), then restart your kernel.")
PIP_CHANGES = ("install", "uninstall")


def say_why_pip_changes_nothing(shell) -> None:
    """Replace IPython's ``%pip`` with one that refuses ``install`` and ``uninstall`` with the reason."""
    original = shell.find_line_magic("pip")
    if original is None:
        return

    def pip(line: str):
        words = line.split()
        if words and words[0] in PIP_CHANGES:
            print(NO_PIP_CHANGES.format(action=words[0]), file=sys.stderr)
            return None
        return original(line)

    pip.__doc__ = original.__doc__
    shell.register_magic_function(pip, "line", "pip")


class Refusals:
    """Mixed in before ``IPythonKernel``. ``refused`` names the ``supported_features`` taken away."""

    refused: tuple[str, ...] = ("debugger",)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if release_name():  # an installed release (docs/upgrades.md), not a venv of the user's own
            say_why_pip_changes_nothing(self.shell)

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
