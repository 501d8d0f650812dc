#!/usr/bin/env bash
# A local multi-host gpuhub cluster: Debian 12 containers with systemd as PID 1 (docs/testing.md).
#
#   scripts/cluster.sh up NAME       build/reuse the image, start hub + gpu1..3, write the inventory
#   scripts/cluster.sh deploy NAME   ansible-playbook site.yml against it
#   scripts/cluster.sh info NAME     the hub URL, the users and their generated passwords
#   scripts/cluster.sh down NAME     remove its containers, network, /home volume and generated files
#   scripts/cluster.sh inventory NAME   print the inventory path (for tests and molecule)
#
# Hosts: `hub1` (hub + notebook host + monitoring) and `gpu1`..`gpu3` (2 fake GPUs each), all
# with one shared /home (a podman volume, as a site's NFS home is).
# Every podman resource is named gpuhub-NAME-*; traffic goes only to the containers' own addresses.
# Generated files live under .cache/NAME/ (ssh key, inventory, credentials).
# Environment: GPUHUB_GPU_NODES (default 3), GPUHUB_FAKE_GPUS (per node, default 2),
# GPUHUB_LOAD_USERS (extra users load01.. for `python -m bench load`, default 0),
# GPUHUB_ANSIBLE_ARGS (extra ansible-playbook arguments for deploy).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="$ROOT/.cache"
export CONTAINERS_CONF="$ROOT/scripts/containers.conf"

# --- the image recipe: any change here gives a new image tag ---------------------------------------
SUITE=bookworm
MIRROR=${GPUHUB_DEBIAN_MIRROR:-http://deb.debian.org/debian}
INCLUDE=systemd,systemd-sysv,dbus,python3,openssh-server,sudo,iproute2,ca-certificates
RECIPE_VERSION=2 # bump when image_build changes what it puts into the image
RECIPE_HASH=$(printf '%s\n' "$SUITE" "$MIRROR" "$INCLUDE" "$RECIPE_VERSION" | sha256sum | cut -c1-12)
IMAGE="localhost/gpuhub-debian:$SUITE-$RECIPE_HASH"

GPU_NODES=${GPUHUB_GPU_NODES:-3}
FAKE_GPUS=${GPUHUB_FAKE_GPUS:-2}
LOAD_USERS=${GPUHUB_LOAD_USERS:-0}

if [ -t 2 ]; then B=$'\033[1m' N=$'\033[0m'; else B='' N=''; fi
log() { printf '%s[cluster %s]%s %s\n' "$B" "$(date +%H:%M:%S)" "$N" "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 2
}

check_name() {
  [[ "$1" =~ ^[a-z][a-z0-9]{0,15}$ ]] || die "cluster name must match [a-z][a-z0-9]{0,15}: '$1'"
}

# The hub's inventory name is hub1: a host called "hub" would clash with the group "hub".
HUB=hub1

hosts() {
  echo "$HUB"
  local i
  for ((i = 1; i <= GPU_NODES; i++)); do echo "gpu$i"; done
}

ctr() { echo "gpuhub-$NAME-$1"; }
net() { echo "gpuhub-$NAME"; }
# One /home for every host, as a site's NFS (or Lustre, CephFS) home is: a notebook saved or a file
# uploaded through JupyterLab on the hub is there for the kernel's replicas on the GPU servers.
home_volume() { echo "gpuhub-$NAME-home"; }

# Fixed addresses, as servers have: a container that is powered off and started again (the
# end-to-end tests do) would otherwise come back with a new one, unknown to the inventory and to
# everything deployed from it. Host N of hosts() gets .(10+N) of the network's /24.
static_ip() {
  local want=$1 subnet h i=0
  subnet=$(podman network inspect "$(net)" --format '{{range .Subnets}}{{.Subnet}} {{end}}' |
    tr ' ' '\n' | grep -m1 -E '^[0-9]+\.[0-9]+\.[0-9]+\.0/24$') ||
    die "network $(net) has no IPv4 /24 subnet"
  for h in $(hosts); do
    [ "$h" = "$want" ] && { echo "${subnet%.0/24}.$((10 + i))"; return; }
    i=$((i + 1))
  done
  die "no host $want"
}

ip_of() {
  podman inspect "$(ctr "$1")" --format "{{(index .NetworkSettings.Networks \"$(net)\").IPAddress}}"
}

# --- image ------------------------------------------------------------------------------------------
image_build() {
  if podman image exists "$IMAGE"; then
    log "image $IMAGE is cached"
    return
  fi
  local work="$CACHE/image" rootfs
  rootfs="$work/rootfs-$RECIPE_HASH"
  mkdir -p "$work"
  rm -rf "$rootfs"
  log "building $IMAGE with debootstrap ($SUITE, about a minute)"
  local started=$SECONDS
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" "$MIRROR" \
    >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    die "debootstrap failed (log: $work/debootstrap.log)"
  }
  # A machine id per container (systemd makes one at boot when the file is empty); no package caches.
  : >"$rootfs/etc/machine-id"
  rm -f "$rootfs/var/lib/dbus/machine-id"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  # Nothing in the containers needs the console gettys.
  rm -f "$rootfs/etc/systemd/system/getty.target.wants/"*
  tar --numeric-owner -C "$rootfs" -c . | podman import --quiet - "$IMAGE" >/dev/null
  rm -rf "$rootfs"
  # Old images of earlier recipes.
  podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/gpuhub-debian:' |
    grep -v ":$SUITE-$RECIPE_HASH\$" | xargs -r podman rmi -f >/dev/null 2>&1 || true
  log "image built in $((SECONDS - started)) s"
}

# --- apt cache: debs are downloaded once per machine ------------------------------------------------
# Each container gets its own /var/cache/apt/archives (apt locks that directory, so containers
# installing at the same time cannot share one); a pool of hard links seeds it and collects
# what the hosts downloaded. apt checks every deb's hash against its lists, so a stale one is
# simply downloaded again.
APT_POOL="$CACHE/apt-pool"

apt_seed() {
  local h=$1 dir="$CACHE/$NAME/apt/$1"
  mkdir -p "$dir/partial" "$APT_POOL"
  find "$APT_POOL" -maxdepth 1 -name '*.deb' -exec ln -f -t "$dir" {} + 2>/dev/null || true
}

apt_collect() {
  [ -d "$CACHE/$NAME/apt" ] || return 0
  mkdir -p "$APT_POOL"
  find "$CACHE/$NAME/apt" -mindepth 2 -maxdepth 2 -name '*.deb' -exec ln -f -t "$APT_POOL" {} + 2>/dev/null || true
}

# --- up ---------------------------------------------------------------------------------------------
wait_systemd() {
  local h=$1 state i
  for ((i = 0; i < 120; i++)); do
    state=$(podman exec "$(ctr "$h")" systemctl is-system-running 2>/dev/null || true)
    case "$state" in
      running | degraded) return 0 ;;
    esac
    sleep 0.5
  done
  die "$h: systemd did not come up (state: ${state:-none})"
}

cmd_up() {
  image_build
  local dir="$CACHE/$NAME"
  mkdir -p "$dir/ssh" "$dir/inventory/group_vars" "$dir/inventory/host_vars"
  [ -f "$dir/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C "gpuhub-$NAME" -f "$dir/ssh/id_ed25519"
  podman network exists "$(net)" || podman network create "$(net)" >/dev/null
  podman volume exists "$(home_volume)" ||
    podman volume create --label "gpuhub.cluster=$NAME" "$(home_volume)" >/dev/null

  local h c
  local -a devopts
  for h in $(hosts); do
    c=$(ctr "$h")
    if podman container exists "$c"; then
      [ "$(podman inspect "$c" --format '{{.State.Running}}')" = true ] || podman start "$c" >/dev/null
      log "$h: running ($c)"
      continue
    fi
    apt_seed "$h"
    device_control_opts "$h"
    # SYS_ADMIN lets systemd inside set up the mount namespaces of hardened units
    # (ProtectSystem=, PrivateTmp=) as it does on bare metal.
    podman run -d --name "$c" --hostname "$h" --network "$(net)" --ip "$(static_ip "$h")" --systemd=always \
      --cap-add SYS_ADMIN "${devopts[@]}" \
      --label "gpuhub.cluster=$NAME" \
      -v "$dir/apt/$h:/var/cache/apt/archives:Z" \
      -v "$(home_volume):/home" \
      "$IMAGE" /sbin/init >/dev/null
    log "$h: started ($c)"
  done
  local pub
  pub=$(cat "$dir/ssh/id_ed25519.pub")
  for h in $(hosts); do
    wait_systemd "$h"
    fake_gpu_nodes "$h"
    # Ansible logs in as an ordinary admin account that may sudo, as on most sites: a task that
    # forgets to become root fails here as it would there.
    podman exec -i "$(ctr "$h")" sh -c '
      id ops >/dev/null 2>&1 || useradd --create-home --shell /bin/bash ops
      echo "ops ALL=(ALL:ALL) NOPASSWD: ALL" > /etc/sudoers.d/ops && chmod 0440 /etc/sudoers.d/ops
      umask 077; mkdir -p ~ops/.ssh; cat > ~ops/.ssh/authorized_keys; chown -R ops:ops ~ops/.ssh' <<<"$pub"
  done
  write_inventory
  log "cluster $NAME is up: inventory $dir/inventory"
}

# Hosts control their units' devices as bare metal does (the agent opens a GPU's device node to a
# kernel only during a grant; servers and daemons get none): systemd inside gets the cgroup
# hierarchy writable, in which it makes its units' cgroups under the container's own, and the
# container may use the fake GPUs' nodes (major FAKE_GPU_MAJOR, of the range Linux leaves to local
# use, served by no driver: an open that the cgroup allows fails with ENXIO, one it refuses with
# EPERM). podman's default, a read-only hierarchy, would enforce no unit's device list.
FAKE_GPU_MAJOR=242
device_control_opts() {  # sets devopts, podman run's options for host $1
  devopts=(--cgroupns=host -v /sys/fs/cgroup:/sys/fs/cgroup:rw "--device-cgroup-rule=c $FAKE_GPU_MAJOR:* rwm")
}

fake_gpu_nodes() {
  # On every host, so that a user's server on a notebook host can be seen not to open them either.
  # /dev is the container's tmpfs, made again at each start (tests stop and start servers): a unit
  # makes the nodes at every boot. 0666 like /dev/nvidia*.
  podman exec -i "$(ctr "$1")" sh -c 'cat > /etc/systemd/system/gpuhub-test-fake-gpu-nodes.service &&
    systemctl daemon-reload && systemctl enable --now --quiet gpuhub-test-fake-gpu-nodes.service' <<UNIT
[Unit]
Description=Test bed: device nodes of the fake GPUs (major $FAKE_GPU_MAJOR, served by no driver)
DefaultDependencies=no
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'for i in \$\$(seq 0 $((FAKE_GPUS - 1))); do [ -e /dev/gpuhub-fake-gpu\$\$i ] || mknod -m 0666 /dev/gpuhub-fake-gpu\$\$i c $FAKE_GPU_MAJOR \$\$i; done'

[Install]
WantedBy=sysinit.target
UNIT
}

# Whether the hub's container mounts the shared /home (a cluster made before it existed does not).
shared_home() {
  podman inspect "$(ctr "$HUB")" --format '{{range .Mounts}}{{.Name}} {{end}}' | grep -qw -- "$(home_volume)"
}

write_inventory() {
  local dir="$CACHE/$NAME/inventory" h ip
  {
    echo "# Generated by scripts/cluster.sh for the local cluster '$NAME'. Do not edit."
    echo "all:"
    echo "  vars:"
    echo "    ansible_user: ops  # may sudo; the plays become root where they need it"
    echo "    ansible_ssh_private_key_file: $CACHE/$NAME/ssh/id_ed25519"
    echo "    # Test containers only: their host keys are throwaway."
    echo "    ansible_ssh_common_args: -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    echo "    gpuhub_test_cluster: $NAME"
    echo "  hosts:"
    for h in $(hosts); do
      ip=$(ip_of "$h")
      [ -n "$ip" ] || die "$h has no address on $(net)"
      echo "    $h:"
      echo "      ansible_host: $ip"
      echo "      gpuhub_container: $(ctr "$h")"
    done
    echo "  children:"
    echo "    hub:"
    echo "      hosts:"
    echo "        $HUB:"
    echo "    notebook_hosts:"
    echo "      hosts:"
    echo "        $HUB:"
    echo "    monitoring:"
    echo "      hosts:"
    echo "        $HUB:"
    echo "    gpu_nodes:"
    echo "      hosts:"
    for h in $(hosts); do
      [ "$h" = "$HUB" ] || echo "        $h:"
    done
  } >"$dir/hosts.yml"
  {
    echo "# Generated by scripts/cluster.sh: the test cluster's settings (see inventory/example for all)."
    echo "gpuhub_users:"
    echo "  - {name: alice, uid: 2001}"
    echo "  - {name: bob, uid: 2002}"
    echo "  - {name: carol, uid: 2003}"
    local u
    for ((u = 1; u <= LOAD_USERS; u++)); do
      printf '  - {name: load%02d, uid: %d}\n' "$u" $((2100 + u))
    done
    if shared_home; then
      echo "# /home is one volume on every host (scripts/cluster.sh home_volume): homes are made on the hub."
      echo "gpuhub_users_shared_home: true"
    fi
    echo "gpuhub_hub_admin_users: [alice]"
    echo "# carol's tiny quota: tests/cluster/test_quota.py uses it up with one cell."
    echo "gpuhub_quota_users:"
    echo "  carol: {gpus: 1, gpu_hours_per_week: 0.001}"
    echo "gpuhub_profiles:"
    echo "  - {name: cpu, display: CPU only, gpus: 0, description: 'numpy, pandas, matplotlib: no GPU'}"
    echo "  - {name: gpu1, display: 1 GPU, gpus: 1, description: 'one GPU while a cell runs'}"
    echo "  - {name: gpu2, display: 2 GPUs, gpus: 2, description: 'two GPUs while a cell runs'}"
    echo "# What the profiles promise: numpy, pandas and matplotlib in every kernel (docs/install.md, Packages for users)."
    echo "gpuhub_python_extra_requirements: \"{{ inventory_dir }}/extra-requirements.txt\""
    echo "gpuhub_hub_tls_san: [\"IP:$(ip_of "$HUB")\", \"DNS:hub\", \"IP:127.0.0.1\"]"
    echo "# Notice a lost node and a dead replica quickly (the end-to-end tests wait for both)."
    echo "gpuhub_scheduler_node_timeout_s: 12"
    echo "gpuhub_scheduler_replica_dead_grace_s: 5"
    echo "# The elastic pool is off; tests/cluster/test_pool.py turns it on with these hooks, which it installs."
    echo "gpuhub_pool_release_command: /usr/local/bin/gpuhub-test-pool-hook release"
    echo "gpuhub_pool_acquire_command: /usr/local/bin/gpuhub-test-pool-hook acquire"
    echo "gpuhub_pool_release_after_s: 0"
    echo "gpuhub_pool_interval_s: 1"
    echo "# Containers are small: keep the limits modest."
    echo "gpuhub_agent_kernel_memory_max: 2G"
    echo "gpuhub_agent_server_memory_max: 2G"
    if [ "$NAME" = demo ]; then
      echo "# Alerts show in Prometheus and Alertmanager only: set alertmanager_webhook_urls to send them."
    else
      echo "# Alerts go to a webhook the cluster tests listen on; the watchdog comes every minute."
      echo "alertmanager_webhook_urls: [\"http://127.0.0.1:9099/alerts\"]"
      echo "alertmanager_watchdog_url: http://127.0.0.1:9099/watchdog"
    fi
    echo "alertmanager_group_wait: 1s"
    echo "alertmanager_group_interval: 10s"
    echo "alertmanager_repeat_interval: 1m"
    echo "# Grafana is in no registry the containers may reach: provisioning files only (roles/grafana)."
    echo "grafana_install_package: false"
    echo "grafana_manage_repo: false"
  } >"$dir/group_vars/all.yml"
  printf '%s\n' "# Generated by scripts/cluster.sh: packages for users' kernels, exact pins." \
    numpy==2.4.6 pandas==3.1.1 matplotlib==3.10.9 >"$dir/extra-requirements.txt"
  {
    echo "# Generated by scripts/cluster.sh: $FAKE_GPUS fake GPUs per node (docs/architecture.md D8)."
    echo "gpuhub_fake_gpus:"
    local i
    for ((i = 0; i < FAKE_GPUS; i++)); do
      echo "  - {name: Fake A100 40GB, memory_mib: 40960, device: /dev/gpuhub-fake-gpu$i}"
    done
  } >"$dir/group_vars/gpu_nodes.yml"
}

# --- deploy -----------------------------------------------------------------------------------------
cmd_deploy() {
  local inv="$CACHE/$NAME/inventory"
  [ -f "$inv/hosts.yml" ] || die "no cluster '$NAME': run scripts/cluster.sh up $NAME first"
  local ap="$ROOT/.venv/bin/ansible-playbook"
  [ -x "$ap" ] || ap=ansible-playbook
  log "deploying site.yml to '$NAME' (a cold run downloads debs and builds the wheelhouse: minutes)"
  local started=$SECONDS rc=0
  # Every GPU server at once: the default, a quarter at a time, is for upgrades under running
  # kernels, and ran the GPU play once per server on the test cluster (docs/testing.md).
  # tests/cluster/test_upgrade.py upgrades in batches. An -e in GPUHUB_ANSIBLE_ARGS comes later and wins.
  # shellcheck disable=SC2086
  (cd "$ROOT" && ANSIBLE_CONFIG="$ROOT/ansible.cfg" "$ap" -i "$inv/hosts.yml" site.yml \
    -e gpuhub_gpu_nodes_serial=100% ${GPUHUB_ANSIBLE_ARGS:-}) || rc=$?
  apt_collect
  [ $rc -eq 0 ] || die "deploy failed (rc=$rc)"
  log "deployed in $((SECONDS - started)) s"
}

# --- info -------------------------------------------------------------------------------------------
cmd_info() {
  local inv="$CACHE/$NAME/inventory"
  [ -f "$inv/hosts.yml" ] || die "no cluster '$NAME'"
  local hub
  hub=$(ip_of "$HUB")
  echo
  echo "gpuhub cluster '$NAME'"
  echo "  JupyterHub:  https://$hub/   (certificate of the cluster CA: $inv/credentials/tls/ca.crt)"
  echo "  Prometheus:  http://$hub:9090/classic/alerts   (and /classic/targets)"
  echo "  Grafana:     not installed here (no registry the containers reach has it); the dashboards it"
  echo "               would show: roles/grafana/files/dashboards/ (import them into any Grafana)"
  echo "  hosts:      " "$(for h in $(hosts); do printf '%s=%s ' "$h" "$(ip_of "$h")"; done)"
  echo "  users (password files under $inv/credentials/users/):"
  local f
  for f in "$inv"/credentials/users/*; do
    [ -f "$f" ] || continue
    printf '    %-8s %s\n' "$(basename "$f")" "$(head -n1 "$f" | cut -d' ' -f1)"
  done
  echo "  ssh:         ssh -i $CACHE/$NAME/ssh/id_ed25519 ops@$hub   (sudo without a password; or: podman exec -it $(ctr "$HUB") bash)"
  echo "  stop:        scripts/cluster.sh down $NAME"
}

# --- down -------------------------------------------------------------------------------------------
ours() {
  local c
  for c in $(podman ps -a --filter "label=gpuhub.cluster=$NAME" --format '{{.Names}}'); do
    [[ "$c" == gpuhub-"$NAME"-* ]] && echo "$c"
  done
  return 0
}

# Run "$@" until it succeeds or `done_check` says the goal is reached anyway; podman can race with
# a systemd container that is just shutting down ("container state improper", "device or resource
# busy"), and a later try finds it stopped. Prints the last error when it gives up.
converge() {
  local what=$1 done_check=$2 try err
  shift 2
  err=$(mktemp)
  for try in 1 2 3 4 5 6; do
    if "$@" >/dev/null 2>"$err" || $done_check; then
      rm -f "$err"
      return 0
    fi
    log "$what failed (try $try of 6), retrying: $(tail -n 1 "$err")"
    sleep $((try * 2))
  done
  log "error: $what still fails:"
  cat "$err" >&2
  rm -f "$err"
  return 1
}

no_containers_left() { [ -z "$(ours)" ]; }
no_network_left() { ! podman network exists "$(net)"; }
no_home_left() { ! podman volume exists "$(home_volume)"; }

cmd_down() {
  apt_collect
  local left
  left=$(ours | tr '\n' ' ')
  if [ -n "${left// /}" ]; then
    # shellcheck disable=SC2086 # one word per container name
    converge "removing $left" no_containers_left podman rm -f -i -t 5 $left || exit 2
    log "removed $left"
  fi
  if podman network exists "$(net)"; then
    converge "removing network $(net)" no_network_left podman network rm -f "$(net)" || exit 2
  fi
  if podman volume exists "$(home_volume)"; then
    converge "removing volume $(home_volume)" no_home_left podman volume rm -f "$(home_volume)" || exit 2
  fi
  rm -rf "${CACHE:?}/$NAME"
  log "cluster $NAME is down"
}

[ $# -ge 1 ] || usage
CMD=$1
NAME=${2:-dev}
check_name "$NAME"
case "$CMD" in
  up) cmd_up ;;
  deploy) cmd_deploy ;;
  info) cmd_info ;;
  down) cmd_down ;;
  inventory) echo "$CACHE/$NAME/inventory" ;;
  image) image_build ;;
  *) usage ;;
esac
