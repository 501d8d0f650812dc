"""``python -m gpuhub.kernel -f CONNECTION_FILE``: one kernel replica."""

import logging
import os
import sys

from ipykernel.kernelapp import IPKernelApp

from gpuhub.kernel.kernel import GpuhubKernel


def main() -> None:
    # To the unit's journal (the real stderr): ipykernel later points sys.stderr at the notebook.
    logging.basicConfig(level=os.environ.get("GPUHUB_LOG_LEVEL", "INFO"), stream=sys.__stderr__,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    IPKernelApp.launch_instance(kernel_class=GpuhubKernel)


if __name__ == "__main__":
    main()
