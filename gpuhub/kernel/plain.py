"""The notebook host's plain "Python 3 (ipykernel)" kernel: ipykernel's own, less its debugger
(gpuhub/kernel/refusals.py). It runs beside the user's Jupyter server on a host that every user's
server shares. Installed as the ``python3`` kernelspec by ``gpuhub kernelspecs install --plain-python3``."""

from __future__ import annotations

from ipykernel.ipkernel import IPythonKernel

from gpuhub.kernel.refusals import Refusals


class PlainKernel(Refusals, IPythonKernel):
    pass
