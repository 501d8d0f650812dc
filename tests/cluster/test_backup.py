"""The hub host is lost and rebuilt, the way docs/backup.md tells an admin to do it: a backup taken
while the hub runs (playbooks/backup.yml), the host's state gone, site.yml installs it afresh, and
playbooks/restore.yml brings back the users' tokens, their login cookies and the hub's certificate.
"""

from __future__ import annotations

import tarfile

import pytest

from tests.cluster.conftest import ansible_playbook
from tests.cluster.test_e2e import HubUser, http_session

pytestmark = pytest.mark.cluster


def test_a_rebuilt_hub_comes_back_from_a_backup(cluster, tmp_path):
    hub = cluster.groups["hub"][0]
    alice = HubUser(cluster, "alice")
    alice.login()
    original_cert = cluster.exec(hub, "cat", "/etc/gpuhub/secrets/proxy/tls.crt")

    backups = tmp_path / "backups"
    ansible_playbook(cluster, "playbooks/backup.yml", "-e", f"gpuhub_backup_dir={backups}")
    (archive,) = backups.glob(f"hub-{hub}-*.tar.gz")
    assert archive.stat().st_mode & 0o777 == 0o600
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"var/lib/gpuhub/hub/jupyterhub.sqlite", "etc/gpuhub/secrets/proxy/tls.key",
            "var/lib/gpuhub/scheduler/books.json"} <= names, names
    assert not cluster.exec(hub, "ls", "-A", "/var/backups/gpuhub").strip(), "a copy of the secrets stayed on the hub"

    # The hub host is lost; the new one gets site.yml: an empty database, and the same certificate
    # (the cluster CA issued it; it is kept on the controller, like every host's).
    cluster.exec(hub, "systemctl", "stop", "jupyterhub.service", "gpuhub-scheduler.service")
    cluster.exec(hub, "sh", "-c", "rm -rf /var/lib/gpuhub/hub/* /var/lib/gpuhub/scheduler/books.json "
                                  "/etc/gpuhub/tls /etc/gpuhub/secrets/proxy/tls.crt /etc/gpuhub/secrets/proxy/tls.key")
    ansible_playbook(cluster, "site.yml")
    assert cluster.exec(hub, "cat", "/etc/gpuhub/secrets/proxy/tls.crt") == original_cert
    fresh = http_session(cluster)
    r = fresh.get(f"{cluster.hub_url}/hub/api/user", headers={"Authorization": f"token {alice.token}"}, timeout=30)
    assert r.status_code == 403, f"the rebuilt hub should not know alice's token yet: {r.status_code}"

    ansible_playbook(cluster, "playbooks/restore.yml", "-e", f"gpuhub_backup_file={archive}")
    # Her API token and her login cookie again.
    r = alice.api("GET", "/hub/api/user")
    assert r.status_code == 200 and r.json()["name"] == "alice", r.text[:300]
    home = alice.s.get(f"{cluster.hub_url}/hub/home", allow_redirects=False, timeout=30)
    assert home.status_code == 200, f"alice's login cookie: {home.status_code} {home.headers.get('location')}"
    # And the restored hub works end to end: a server, a kernel on the GPU servers, a cell.
    alice.start_server("gpu1")
    try:
        kid = alice.start_kernel("gpuhub-gpu1")
        channel = alice.kernel(kid)
        try:
            assert channel.run("print(6 * 7)")["stdout"].strip() == "42"
        finally:
            channel.close()
            alice.api("DELETE", f"/user/alice/api/kernels/{kid}")
    finally:
        alice.stop_server()
