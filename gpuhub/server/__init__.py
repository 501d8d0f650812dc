"""Runs inside the user's Jupyter server: the kernel provisioner and each kernel's router (docs/architecture.md D3)."""
