"""``python -m gpuhub.kernel -f CONNECTION_FILE``: one kernel replica."""

import logging
import os
import sys

from ipykernel.kernelapp import IPKernelApp

from gpuhub.kernel.kernel import GpuhubKernel


def main() -> None:
    # To the unit's journal. ipykernel later captures file descriptor 2 itself and forwards what is
    # written there to the notebook, so log through a private duplicate of the original stderr.
    journal = os.fdopen(os.dup(sys.__stderr__.fileno()), "w", buffering=1)
    logging.basicConfig(level=os.environ.get("GPUHUB_LOG_LEVEL", "INFO"), stream=journal,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:]
    if os.environ.get("GPUHUB_PEERS_FILE"):
        # Replicas keep the session's history in memory: three replicas writing one SQLite file
        # in a shared home (over NFS, on a cluster) lock each other out ("database is locked"
        # printed into a cell's output), and every replica records every cell anyway.
        argv.append("--HistoryManager.hist_file=:memory:")
    IPKernelApp.launch_instance(argv=argv, kernel_class=GpuhubKernel)


if __name__ == "__main__":
    main()
