# Sourced by scripts/slurm-cluster (its globals: NET, NET_ID, BRIDGE, NODE, RUN, SPOOL, LOG,
# CONF, HOSTS_FILE, NODES_FILE, PIDFILE; its helpers: die, pid_in, rotate_log).
# ---------------------------------------------------------------- nodes ---
# One node: `localhost` in this network namespace (127.0.0.1). N >= 2 nodes: node1..nodeN,
# each in its own network, UTS and mount namespace, with its own slurmd; they talk over
# the bridge $BRIDGE ($NET.0/24: slurmctld reaches them at $NET.(10+K), they reach it at $NET.1).
NODES=1
node_names() {
  if ((NODES == 1)); then echo "$NODE"; return; fi
  local k
  for ((k = 1; k <= NODES; k++)); do echo "node$k"; done
}
node_addr() { echo "$NET.$((10 + $1))"; }
netns_of() { echo "dtr$NET_ID-node$1"; }
slurmd_pidfile() { [[ $1 == "$NODE" ]] && echo "${PIDFILE[slurmd]}" || echo "$RUN/slurmd-$1.pid"; }
read_nodes() { [[ -r $NODES_FILE ]] && NODES=$(tr -dc '0-9' <"$NODES_FILE") && ((NODES >= 1)) || NODES=1; }

# Idempotent: bridge, one namespace per node with a veth into the bridge.
net_up() {
  local k ns host_if
  command -v ip >/dev/null || die "--nodes $NODES needs iproute2 ('ip')"
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE (needs CAP_NET_ADMIN)"
  fi
  ip addr replace "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for ((k = 1; k <= NODES; k++)); do
    ns=$(netns_of "$k") host_if="dtr${NET_ID}n$k"
    [[ -e /run/netns/$ns ]] || ip netns add "$ns" || die "cannot create network namespace $ns"
    if ! ip link show "$host_if" >/dev/null 2>&1; then
      ip link add "$host_if" type veth peer name eth0 netns "$ns" || die "cannot create veth $host_if"
    fi
    ip link set "$host_if" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr replace "$(node_addr "$k")/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

net_down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^dtr$NET_ID-node[0-9]+$" || true); do
    ip netns del "$ns" 2>/dev/null || true      # takes its veth pair with it
  done
  ! ip link show "$BRIDGE" >/dev/null 2>&1 || ip link del "$BRIDGE" 2>/dev/null || true
}

# A zombie counts as gone: PID 1 in some containers reaps exited daemons late.
alive() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }          # field 3 (state) follows "(comm) "
  [[ ${stat%% *} != Z ]]
}
is_up() { daemon_pid "$1" >/dev/null; }
# Up, counting a munged that someone else runs on the default socket.
daemon_up() { is_up "$1" || { [[ $1 == munged ]] && munge_works; }; }

# wait_for DESCRIPTION LOGFILE CMD...: poll CMD every 0.2 s for up to $TIMEOUT s.
wait_for() {
  local what=$1 log=$2; shift 2
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "$what did not happen within ${TIMEOUT}s" "$log"
    sleep 0.2
  done
}

# Each daemon start gets a fresh log (the previous one is kept as .1), so the
# log tail shown on failure is about this start.
rotate_log() { [[ ! -e $1 ]] || mv -f "$1" "$1.1"; }

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

munge_works() { munge -n -S "$MUNGE_SOCK" </dev/null 2>/dev/null | unmunge -S "$MUNGE_SOCK" >/dev/null 2>&1; }
mysql_root() { mariadb --no-defaults --socket="$MYSQL_SOCK" -u root "$@"; }

# Folders a non-root daemon writes to must be owned by it, and every parent must
# be traversable by it (mariadbd dies silently otherwise).
# Mode 755 except the DB datadir, so `status` works for users other than root.
owned_dir() {
  local user=$1 dir=$2 mode=${3:-755}
  mkdir -p "$dir"
  chown "$user:$user" "$dir"
  chmod "$mode" "$dir"
  runuser -u "$user" -- test -w "$dir" ||
    die "user '$user' cannot reach $dir (a parent folder is not world-traversable); set DTRAIN_SLURM_DIR to e.g. /tmp/dtrain-slurm"
}

missing_packages() {  # prints the binaries that are not installed
  local b
  for b in sbatch slurmctld slurmd slurmdbd munged mariadbd; do
    command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || echo "$b"
  done
}

# One slurmd per node, inside the node's network namespace and a fresh UTS + mount namespace:
# its hostname is nodeK and its /etc/hosts is etc/hosts, which every job step inherits.
start_node_slurmds() {
  local k name ns
  for ((k = 1; k <= NODES; k++)); do
    name=node$k ns=$(netns_of "$k")
    pid_in "$(slurmd_pidfile "$name")" slurmd >/dev/null && continue
    rotate_log "$LOG/slurmd-$name.log"
    mkdir -p "$SPOOL/slurmd-$name"
    # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mount slurmd checks.
    setsid nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
      sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && exec /usr/sbin/slurmd -f "$3" -N "$2"' \
      sh "$HOSTS_FILE" "$name" "$CONF" 9>&- </dev/null >>"$LOG/slurmd-$name.out" 2>&1 ||
      die "slurmd of $name failed to start" "$LOG/slurmd-$name.log"
  done
}

