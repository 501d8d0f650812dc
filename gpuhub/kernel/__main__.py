"""``python -m gpuhub.kernel -f CONNECTION_FILE``: one kernel replica."""

import logging
import os
import sys
import threading

import zmq
from ipykernel.kernelapp import IPKernelApp

from gpuhub.kernel.jedi_cache import make_completion_cache_safe
from gpuhub.kernel.kernel import GpuhubKernel
from gpuhub.kernel.shell_settings import OWN_LOGGERS


def _exit_when_the_heartbeat_dies() -> None:
    """ipykernel's heartbeat is a thread that binds its port on its own: if the bind fails (the port
    was taken meanwhile), the thread dies and the kernel runs on without it, never counted live by
    its router but still voting in its Raft group. Exit instead, loudly, so that the unit's restart
    (or the scheduler's replacement) brings a whole replica back."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is None or args.thread.name != "Heartbeat":
            previous(args)
            return
        logging.getLogger("gpuhub.kernel").critical(
            "the heartbeat thread failed; exiting, since the router cannot see this replica without it",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
        os._exit(3)

    threading.excepthook = hook


def log_to_the_journal() -> None:
    """gpuhub's own loggers to the unit's journal. ipykernel later captures file descriptor 2
    itself and forwards what is written there to the notebook, so they log through a private
    duplicate of the original stderr. The root logger stays the user's, as in a plain ipykernel (no
    handler, WARNING): a cell's ``logging.basicConfig(level=logging.INFO)`` must take effect, and a
    library's warnings must reach the notebook."""
    journal = os.fdopen(os.dup(sys.__stderr__.fileno()), "w", buffering=1)
    handler = logging.StreamHandler(journal)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = os.environ.get("GPUHUB_LOG_LEVEL", "INFO").upper()
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False  # not into the notebook, whatever the user does with the root logger


class ReplicaApp(IPKernelApp):
    """ipykernel's application, with an iopub that welcomes every subscription (JEP 65).

    ipykernel's XPUB reports a topic's first subscription only. The router's SUB reconnects after
    a pause (a replica stopped or starved past the ZeroMQ heartbeat timeout); when its new
    connection subscribes before the replica has dropped the old one, the subscription is a
    second one to the same topic: never reported, never welcomed, and the router never sends that
    replica a cell again."""

    def log_connection_info(self) -> None:
        """ipykernel prints a note for whoever ran ``ipython kernel`` in a terminal (Ctrl-C will not
        work, ``--existing FILE``) on stdout, which is the replica's journal, at every start: as a
        kernel started by a parent it only logs the lines (below the journal's level)."""
        handle = self.parent_handle
        self.parent_handle = 1
        try:
            super().log_connection_info()
        finally:
            self.parent_handle = handle

    def _configure_logging(self) -> None:
        """traitlets leaves the application's logger at DEBUG and filters at its handlers, so
        each of ipykernel's ``log.debug`` calls in a cell's path (three, one of them the whole
        reply) built a record that every handler then dropped: once the configuration (with
        any ``logging_config``) is in place, the logger takes its handlers' lowest level. (A
        traitlets that renamed this method would only bring back the cost.)"""
        super()._configure_logging()
        logger = logging.getLogger(self.__class__.__name__)  # not self.log: its default calls here
        levels = [handler.level for handler in logger.handlers]
        if levels:
            logger.setLevel(min(levels) or logging.DEBUG)  # a handler at NOTSET takes everything

    def init_iopub(self, context) -> None:
        super().init_iopub(context)
        thread = self.iopub_thread
        # on the IOPub thread, the only one that may touch its socket (it runs already)
        thread.io_loop.add_callback(thread.socket.setsockopt, zmq.XPUB_VERBOSE, 1)


def main() -> None:
    log_to_the_journal()
    _exit_when_the_heartbeat_dies()
    make_completion_cache_safe()
    argv = sys.argv[1:]
    if os.environ.get("GPUHUB_PEERS_FILE"):
        # Replicas keep the session's history in memory: three replicas writing one SQLite file
        # in a shared home (over NFS, on a cluster) lock each other out ("database is locked"
        # printed into a cell's output), and every replica records every cell anyway.
        argv.append("--HistoryManager.hist_file=:memory:")
    ReplicaApp.launch_instance(argv=argv, kernel_class=GpuhubKernel)


if __name__ == "__main__":
    main()
