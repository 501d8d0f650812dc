"""``python -m gpuhub.kernel -f CONNECTION_FILE``: one kernel replica."""

from ipykernel.kernelapp import IPKernelApp

from gpuhub.kernel.kernel import GpuhubKernel


def main() -> None:
    IPKernelApp.launch_instance(kernel_class=GpuhubKernel)


if __name__ == "__main__":
    main()
