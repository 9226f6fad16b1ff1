#!/usr/bin/env bash
# A test cluster on one machine: N nodes as network namespaces, with sshd, Open MPI and Slurm.
#
#   bash scripts/cluster.sh install          # Debian packages it needs, when missing (root, apt-get)
#   bash scripts/cluster.sh probe            # exit 0 when network namespaces can be made here
#   bash scripts/cluster.sh up               # 2 nodes: dfn1, dfn2 (DUALFRAME_CLUSTER_NODES=4 for 4)
#   bash scripts/cluster.sh exec dfn1 CMD    # run CMD on node dfn1 (its network, its host name)
#   bash scripts/cluster.sh status           # what is up; exit 0 when the whole cluster answers
#   bash scripts/cluster.sh down             # remove everything `up` made; safe to run twice
#
# Layout: a hub namespace (dfhub) holds a bridge; each node dfnI is a namespace with one veth (eth0)
# into it and the address $NET.I/24. The host's own namespace gets no interface and no route, so
# nothing here can talk to anything but the cluster's own addresses. Each node's /etc/hosts is
# /etc/netns/dfnI/hosts (`ip netns exec` mounts it over /etc/hosts): the host's /etc/hosts is not edited.
# On each node: sshd (key made here, client config in $STATE/ssh_config, `ssh` wrapper in $STATE/bin),
# slurmd -N dfnI; on dfn1 also slurmctld; one munged for all (a unix socket crosses namespaces).
# Processes on a node run in their own UTS namespace with the node's host name, so MPI, Horovod and
# Slurm see N hosts. Everything lives in $STATE (default /run/dualframe-cluster) and is removed by down.
#
# Settings: DUALFRAME_CLUSTER_NODES (2..8, default 2), DUALFRAME_CLUSTER_NET (default 10.203.7),
# DUALFRAME_CLUSTER_CPUS (Slurm CPUs per node, default 4: oversubscribed slots on purpose).
set -euo pipefail

NODES=${DUALFRAME_CLUSTER_NODES:-2}
NET=${DUALFRAME_CLUSTER_NET:-10.203.7}
CPUS=${DUALFRAME_CLUSTER_CPUS:-4}
STATE=/run/dualframe-cluster
# This checkout: the nodes run its .venv and tests at the same path.
CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
HUB=dfhub
PACKAGES=(openssh-server slurmd slurmctld slurm-client munge iproute2 util-linux)

say() { echo "[cluster] $*" >&2; }
die() { echo "[cluster] error: $*" >&2; exit 1; }
node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "dfn$i"; done; }
# The nodes up now (what down and status act on), else the ones NODES asks for.
current_nodes() { if [ -f "$STATE/nodes" ]; then cat "$STATE/nodes"; else node_names; fi; }

# Run "$@" on node $1: its network namespace, its /etc/hosts, its host name, its own /tmp (as on real
# nodes: Slurm's PMIx and Open MPI keep per-node files there), the cluster's ssh and Slurm. A checkout
# under /tmp (mktemp -d) stays at its path there: held at $STATE/checkout while the node's /tmp is
# mounted, then bound back over an empty folder of the same name (mounts private to the node's process).
on_node() {
  local node=$1; shift
  mkdir -p "$STATE/checkout"
  ip netns exec "$node" unshare --uts --mount env PATH="$STATE/bin:$PATH" SLURM_CONF="$STATE/slurm/slurm.conf" \
    sh -c 'set -e
      case "$2/" in /tmp/*) mount --bind "$2" "$3" ;; esac
      mount --bind "$1" /tmp
      case "$2/" in /tmp/*) mkdir -p "$2" && mount --bind "$3" "$2" ;; esac
      hostname "$0"; shift 3; exec "$@"' "$node" "$STATE/tmp/$node" "$CHECKOUT" "$STATE/checkout" "$@"
}

need_root() {
  [ "$(id -u)" = 0 ] || die "$1 needs root (network namespaces, daemons): sudo bash scripts/cluster.sh $1"
}

missing_packages() {
  local missing=()
  command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  [ -x /usr/sbin/slurmd ] || missing+=(slurmd)
  [ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
  command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
  [ -x /usr/sbin/munged ] || missing+=(munge)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
  echo "${missing[@]}"
}

cmd_install() {
  local missing; missing=$(missing_packages)
  [ -z "$missing" ] && return 0
  need_root install
  command -v apt-get >/dev/null 2>&1 || die "missing $missing and no apt-get: install them with your package manager"
  say "installing Debian packages: $missing"
  # Package scripts must not start system-wide sshd/munged/slurm daemons on the host: deny service starts.
  local policy=/usr/sbin/policy-rc.d added=0
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' > $policy; chmod +x $policy; added=1; fi
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  { apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; }; } \
    || { [ $added = 1 ] && rm -f $policy; die "apt-get install $missing failed"; }
  [ $added = 1 ] && rm -f $policy
  return 0
}

# Directories outside $STATE that up makes when missing, listed so down removes exactly those.
made_dir() {
  [ -d "$1" ] && return 0
  mkdir -p "$1" && echo "$1" >> "$STATE/made-dirs"
}

write_ssh() {
  mkdir -p "$STATE/bin" "$STATE/ssh"
  ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/id_ed25519" -C dualframe-cluster
  ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/host_ed25519_key" -C dualframe-cluster-host
  cp "$STATE/ssh/id_ed25519.pub" "$STATE/ssh/authorized_keys"
  cat > "$STATE/ssh/sshd_config" <<EOF
Port 22
HostKey $STATE/ssh/host_ed25519_key
AuthorizedKeysFile $STATE/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
X11Forwarding no
MaxStartups 100
MaxSessions 100
# A session whose client is gone (its node cut off) ends, with what it started (orted, task services).
ClientAliveInterval 5
ClientAliveCountMax 6
EOF
  cat > "$STATE/ssh/ssh_config" <<EOF
Host *
  IdentityFile $STATE/ssh/id_ed25519
  UserKnownHostsFile $STATE/ssh/known_hosts
  StrictHostKeyChecking no
  BatchMode yes
  LogLevel ERROR
  ConnectTimeout 5
  # A node cut off ends its ssh within 30 s (15 s lost sessions under load): mpirun and horovodrun then see it gone.
  ServerAliveInterval 5
  ServerAliveCountMax 6
EOF
  # horovodrun and mpirun call plain `ssh`: this one, first on PATH in `on_node`, reads the cluster's config.
  printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$STATE/ssh/ssh_config" > "$STATE/bin/ssh"
  chmod 755 "$STATE/bin/ssh"
  made_dir /run/sshd   # sshd's privilege-separation directory
}

write_slurm() {
  local dir=$STATE/slurm node i
  mkdir -p "$dir/ctld" "$STATE/munge"
  # One munged for all nodes, with its own key and socket (the host's /etc/munge is left alone).
  chown munge:munge "$STATE/munge"; chmod 711 "$STATE/munge"
  dd if=/dev/urandom bs=1 count=1024 status=none > "$STATE/munge/munge.key"
  chown munge:munge "$STATE/munge/munge.key"; chmod 400 "$STATE/munge/munge.key"
  {
    echo "ClusterName=dualframe"
    echo "SlurmctldHost=dfn1($NET.1)"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$STATE/munge/munge.socket"
    echo "CredType=cred/munge"
    echo "MpiDefault=pmix"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "StateSaveLocation=$dir/ctld"
    echo "SlurmdSpoolDir=$dir/spool-%n"
    echo "SlurmctldPidFile=$dir/slurmctld.pid"
    echo "SlurmdPidFile=$dir/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/slurmctld.log"
    echo "SlurmdLogFile=$dir/slurmd-%n.log"
    echo "SlurmdTimeout=20"
    echo "KillWait=5"
    echo "MessageTimeout=10"
    for node in $(node_names); do
      i=${node#dfn}
      echo "NodeName=$node NodeAddr=$NET.$i CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$dir/slurm.conf"
  for node in $(node_names); do mkdir -p "$dir/spool-$node"; done
  # slurmd reads cgroup.conf even with proctrack/linuxproc; name the hierarchy this machine has.
  local cgroup=cgroup/v1; [ -f /sys/fs/cgroup/cgroup.controllers ] && cgroup=cgroup/v2
  printf 'CgroupPlugin=%s\nIgnoreSystemd=yes\n' "$cgroup" > "$dir/cgroup.conf"
}

start_node() {
  local node=$1 i=${1#dfn}
  ip netns add "$node"
  ip -n "$HUB" link add "v$node" type veth peer name eth0 netns "$node"
  ip -n "$HUB" link set "v$node" master br0 up
  ip -n "$node" link set lo up
  ip -n "$node" addr add "$NET.$i/24" dev eth0
  ip -n "$node" link set eth0 up
  made_dir /etc/netns
  mkdir -p "/etc/netns/$node" "$STATE/tmp/$node"
  chmod 1777 "$STATE/tmp/$node"
  {
    echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    local other; for other in $(node_names); do echo "$NET.${other#dfn} $other"; done
  } > "/etc/netns/$node/hosts"
  on_node "$node" /usr/sbin/sshd -f "$STATE/ssh/sshd_config" -o "PidFile=$STATE/ssh/sshd-$node.pid" \
    -E "$STATE/ssh/sshd-$node.log"
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: retry COMMAND every half second
  local deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { say "timed out waiting for $what"; return 1; }
    sleep 0.5
  done
}

cmd_up() {
  need_root up
  [[ $NODES =~ ^[0-9]+$ ]] && [ "$NODES" -ge 2 ] && [ "$NODES" -le 8 ] \
    || die "DUALFRAME_CLUSTER_NODES must be 2..8 (DUALFRAME_CLUSTER_NODES=$NODES)"
  [ -z "$(missing_packages)" ] || die "missing packages: $(missing_packages); run: bash scripts/cluster.sh install"
  if [ -d "$STATE" ]; then
    # The daemons were started from one checkout (its path bound in their mounts when under /tmp).
    if cmd_status >/dev/null 2>&1 && [ "$(cat "$STATE/nodes")" = "$(node_names)" ] \
        && [ "$(cat "$STATE/checkout_path" 2>/dev/null)" = "$CHECKOUT" ]; then say "already up"; return 0; fi
    say "a partial or different cluster is there: taking it down first"; cmd_down
  fi
  mkdir -p "$STATE/work"; chmod 755 "$STATE"; chmod 1777 "$STATE/work"   # work: shared by all nodes
  node_names > "$STATE/nodes"
  echo "$CHECKOUT" > "$STATE/checkout_path"
  ip netns add "$HUB"
  ip -n "$HUB" link add br0 type bridge
  ip -n "$HUB" link set br0 up
  write_ssh
  write_slurm
  local node
  for node in $(node_names); do start_node "$node"; done
  runuser -u munge -- /usr/sbin/munged --socket="$STATE/munge/munge.socket" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"
  on_node dfn1 /usr/sbin/slurmctld
  for node in $(node_names); do on_node "$node" /usr/sbin/slurmd -N "$node"; done
  for node in $(node_names); do
    wait_for 20 "ssh dfn1 -> $node" on_node dfn1 ssh "$node" true || up_failed "sshd on $node does not answer" "$STATE/ssh/sshd-$node.log"
  done
  wait_for 60 "slurm nodes idle" slurm_ready || up_failed "Slurm nodes did not come up" "$STATE"/slurm/*.log
  say "up: $(node_names | tr '\n' ' ')on $NET.0/24; run commands with: bash scripts/cluster.sh exec dfn1 CMD"
}

up_failed() {  # up_failed MESSAGE LOG...: show the logs' tails, leave the cluster for a look (down removes it)
  local message=$1 log; shift
  for log in "$@"; do [ -f "$log" ] && { say "--- $log"; tail -n 15 "$log" >&2; }; done
  die "$message; look in $STATE, then: bash scripts/cluster.sh down"
}

slurm_ready() {  # every node idle in sinfo
  local states; states=$(on_node dfn1 sinfo -h -N -o '%N %t') || return 1
  [ "$(echo "$states" | grep -c ' idle$')" = "$(current_nodes | wc -l)" ]
}

kill_pidfile() {
  local file=$1 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file" 2>/dev/null || true)
  [[ $pid =~ ^[0-9]+$ ]] && kill "$pid" 2>/dev/null || true
}

cmd_down() {
  need_root down
  local node pid pids
  if [ -d "$STATE" ]; then
    kill_pidfile "$STATE/slurm/slurmctld.pid"
    for node in $(current_nodes); do
      kill_pidfile "$STATE/slurm/slurmd-$node.pid"; kill_pidfile "$STATE/ssh/sshd-$node.pid"
    done
    kill_pidfile "$STATE/munge/munged.pid"
  fi
  # Whatever still runs inside the cluster's namespaces was started in them (jobs, ssh sessions).
  for node in $(current_nodes) $HUB; do
    ip netns list | grep -qw "^$node" || continue
    for sig in TERM KILL; do
      pids=$(ip netns pids "$node" 2>/dev/null || true)
      [ -n "$pids" ] || break
      for pid in $pids; do kill -s $sig "$pid" 2>/dev/null || true; done
      sleep 1
    done
  done
  for node in $(current_nodes); do
    ip netns list | grep -qw "^$node" && ip netns del "$node"
    rm -rf "/etc/netns/$node"
  done
  ip netns list | grep -qw "^$HUB" && ip netns del "$HUB"
  local made
  if [ -f "$STATE/made-dirs" ]; then
    while read -r made; do rmdir "$made" 2>/dev/null || true; done < "$STATE/made-dirs"
  fi
  rm -rf "$STATE"
  say "down"
}

cmd_status() {
  [ -d "$STATE" ] || { echo "down"; return 1; }
  local ok=0 node
  for node in $(current_nodes); do
    if ! ip netns list | grep -qw "^$node"; then echo "$node: no namespace"; ok=1; continue; fi
    local addr; addr=$(ip -n "$node" -4 -o addr show eth0 2>/dev/null | awk '{print $4}')
    local link; link=$(ip -n "$node" -o link show eth0 2>/dev/null | grep -q 'state UP' && echo up || echo down)
    local sshd; sshd=$(on_node dfn1 ssh "$node" hostname 2>/dev/null || echo "NO ANSWER")
    echo "$node: eth0 $addr $link; ssh from dfn1: $sshd"
    [ "$sshd" = "$node" ] || ok=1
  done
  on_node dfn1 sinfo -N -o '%N %t %c %G' 2>/dev/null || { echo "slurm: no answer"; ok=1; }
  return $ok
}

# Exit 0 when this machine lets us make network namespaces (root, and a kernel/container that allows it).
cmd_probe() {
  [ "$(id -u)" = 0 ] || { echo "not root"; return 1; }
  local name=dfprobe$$
  ip netns add $name 2>/dev/null || { echo "network namespaces cannot be made here (ip netns add failed)"; return 1; }
  ip netns del $name
}

case ${1:-} in
  install) cmd_install ;;
  probe) cmd_probe ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  exec) shift; [ $# -ge 2 ] || die "usage: cluster.sh exec NODE COMMAND..."; need_root exec; on_node "$@" ;;
  *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
