"""Kernelspecs for the inventory's profiles: "Python 3 (CPU)", "Python 3 (1 GPU)", …"""

from __future__ import annotations

import json
import os
from pathlib import Path


def display_name(gpus: int) -> str:
    if gpus == 0:
        return "Python 3 (CPU)"
    return f"Python 3 ({gpus} GPU{'s' if gpus > 1 else ''})"


def kernelspec(gpus: int, replicas: int, python: str) -> dict:
    return {
        "argv": [python, "-m", "gpuhub.kernel", "-f", "{connection_file}"],
        "display_name": display_name(gpus),
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {
            "debugger": False,
            "kernel_provisioner": {
                "provisioner_name": "gpuhub-provisioner",
                "config": {"gpus": gpus, "replicas": replicas},
            },
        },
    }


def plain_kernelspec(python: str) -> dict:
    """ipykernel's own "python3" kernelspec, less the debugger (gpuhub/kernel/plain.py)."""
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 "--IPKernelApp.kernel_class=gpuhub.kernel.plain.PlainKernel"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "metadata": {"debugger": False},
    }


def parse_profile(text: str) -> tuple[str, int]:
    name, sep, gpus = text.partition(":")
    if not sep or not name or not gpus.isdigit():
        raise ValueError(f"profile must look like NAME:GPUS (e.g. gpu1:1), not {text!r}")
    if not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"profile name {name!r} may contain only letters, digits, '-' and '_'")
    return name.lower(), int(gpus)


def install(prefix: str, profiles: list[tuple[str, int]], replicas: int, prune: bool = True,
            plain_python3: bool = False) -> list[str]:
    """Write one kernelspec per profile under PREFIX/share/jupyter/kernels, and with
    ``plain_python3`` the plain kernel's "python3" over ipykernel's; return what changed."""
    root = Path(prefix) / "share" / "jupyter" / "kernels"
    python = str(Path(prefix) / "bin" / "python")
    changes = []
    wanted = set()
    specs = [(f"gpuhub-{name}", kernelspec(gpus, replicas, python)) for name, gpus in profiles]
    if plain_python3:
        specs.append(("python3", plain_kernelspec(python)))
    for dirname, spec in specs:
        kdir = root / dirname
        wanted.add(kdir.name)
        text = json.dumps(spec, indent=2) + "\n"
        path = kdir / "kernel.json"
        if not path.exists() or path.read_text() != text:
            kdir.mkdir(parents=True, exist_ok=True)
            # A new file renamed over the old: a release cloned from another shares its files
            # (roles/gpuhub_python/files/clone_release.py), and a reader never sees half a spec.
            tmp = path.with_name(".kernel.json.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            changes.append(f"changed: {path}")
    if prune and root.is_dir():
        for old in root.glob("gpuhub-*"):
            if old.name not in wanted and (old / "kernel.json").exists():
                (old / "kernel.json").unlink()
                old.rmdir()
                changes.append(f"removed: {old}")
    return changes
