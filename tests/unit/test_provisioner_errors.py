"""What a user's kernel-start dialog shows of a failed start: gpuhub's message as it was written."""

from __future__ import annotations

import pickle

from tornado.web import HTTPError

from gpuhub.server.provisioner import KernelLaunchFailed


def test_a_launch_failure_keeps_its_message_whole_and_is_an_http_error_for_jupyter_server():
    failed = KernelLaunchFailed("replica 0 on gpu1 (failed):\n 100%|██████| 3/3\nImportError: no torch")
    # Jupyter Server answers an HTTPError with its log_message; tornado would escape every "%".
    assert isinstance(failed, HTTPError) and isinstance(failed, RuntimeError) and failed.status_code == 503
    assert failed.log_message == str(failed) == "replica 0 on gpu1 (failed):\n 100%|██████| 3/3\nImportError: no torch"
    again = pickle.loads(pickle.dumps(KernelLaunchFailed("at 50%", status=400)))
    assert (again.log_message, again.status_code) == ("at 50%", 400)
