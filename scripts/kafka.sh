#!/usr/bin/env bash
# A real Apache Kafka broker (KRaft, no ZooKeeper, no Docker) for development and tests.
#
#   scripts/kafka.sh start [--brokers 1|3] [--fresh] [--sasl]
#                                            install on first use, format, start, wait until it answers;
#                                            --fresh: when no broker runs, start from empty storage (the
#                                            test command uses it: a data dir left by earlier runs holds
#                                            thousands of test topics, and recovering them after an
#                                            unclean stop takes minutes)
#                                            --sasl (one broker only): also a SASL_PLAINTEXT listener on
#                                            $KAFKA_SASL_PORT and a SASL_SSL one on $KAFKA_SASL_PORT+1,
#                                            both SCRAM-SHA-256 only; the SCRAM user is created when the
#                                            storage is formatted, the TLS certificate is signed by a CA
#                                            made with openssl ($KAFKA_DATA_DIR/tls/ca.pem; clients
#                                            trust it with ssl.ca.location). No authorizer: any
#                                            authenticated user may do anything. Use it on its own
#                                            KAFKA_PORT (e.g. 29092) so the default broker is untouched.
#   scripts/kafka.sh stop                    stop every broker this script started
#   scripts/kafka.sh status                  exit 0 when running (prints the bootstrap list)
#   scripts/kafka.sh kill <node-id>          SIGKILL one broker of a cluster (failure tests)
#   scripts/kafka.sh restart-node <node-id>  start one stopped broker of a cluster again
#
# Kafka's jars come from Maven Central (org.apache.kafka:kafka_2.13) through `mvn
# dependency:copy-dependencies` and are cached under $KAFKA_CACHE_DIR, so every start after the
# first takes seconds.
#
# Environment (all optional):
#   KAFKA_VERSION    Kafka version from Maven Central        (default 4.2.2)
#   KAFKA_PORT       first broker's client port              (default 9092; brokers 2, 3 use +1, +2)
#   KAFKA_DATA_DIR   log dirs, configs, pid files, logs      (default $HOME/.cache/streaming-hub/kafka-data-$KAFKA_PORT)
#   KAFKA_CACHE_DIR  where the jars are cached               (default $HOME/.cache/streaming-hub/kafka-$KAFKA_VERSION)
#   KAFKA_HEAP       JVM heap per broker                     (default 640m)
#   KAFKA_RESTART_TIMEOUT_S  restart-node: seconds to wait for the broker to answer (default 180)
#   KAFKA_EXTRA_CONFIG  more server.properties lines, one per line (default none; for experiments,
#                    e.g. KAFKA_EXTRA_CONFIG='num.io.threads=2')
#   KAFKA_SASL_PORT  --sasl: the SASL_PLAINTEXT port         (default $KAFKA_PORT+2; SASL_SSL is +1)
#   KAFKA_SASL_USER, KAFKA_SASL_PASSWORD
#                    --sasl: the SCRAM-SHA-256 user          (default streaming-hub / streaming-hub-secret)
set -euo pipefail

KAFKA_VERSION="${KAFKA_VERSION:-4.2.2}"
KAFKA_PORT="${KAFKA_PORT:-9092}"
CACHE_ROOT="${HOME}/.cache/streaming-hub"
KAFKA_CACHE_DIR="${KAFKA_CACHE_DIR:-$CACHE_ROOT/kafka-$KAFKA_VERSION}"
KAFKA_DATA_DIR="${KAFKA_DATA_DIR:-$CACHE_ROOT/kafka-data-$KAFKA_PORT}"
KAFKA_HEAP="${KAFKA_HEAP:-640m}"
KAFKA_SASL_PORT="${KAFKA_SASL_PORT:-$((KAFKA_PORT + 2))}"
KAFKA_SASL_USER="${KAFKA_SASL_USER:-streaming-hub}"
KAFKA_SASL_PASSWORD="${KAFKA_SASL_PASSWORD:-streaming-hub-secret}"
LOG4J_VERSION_FALLBACK="2.24.3"

log() { echo "kafka.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

controller_port() { echo $((KAFKA_PORT + 1000 + $1 - 1)); }
client_port() { echo $((KAFKA_PORT + $1 - 1)); }
node_dir() { echo "$KAFKA_DATA_DIR/node-$1"; }

install_kafka() {
  if [[ -f "$KAFKA_CACHE_DIR/.complete" ]]; then return 0; fi
  command -v mvn >/dev/null || die "Maven (mvn) is required to install Kafka from Maven Central"
  command -v java >/dev/null || die "Java 17+ is required to run Kafka"
  log "installing Apache Kafka $KAFKA_VERSION from Maven Central into $KAFKA_CACHE_DIR (first use only)"
  local work; work="$(mktemp -d)"
  mkdir -p "$KAFKA_CACHE_DIR/libs"
  # Resolve the broker's runtime classpath first, to learn which log4j-core it brings.
  write_pom "$work" ""
  mvn -q -B -C -f "$work/pom.xml" dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$KAFKA_CACHE_DIR/libs" >"$work/mvn.log" 2>&1 || { cat "$work/mvn.log" >&2; die "maven resolution failed"; }
  local core; core="$(ls "$KAFKA_CACHE_DIR/libs" | sed -n 's/^log4j-core-\(.*\)\.jar$/\1/p' | head -1)"
  [[ -n "$core" ]] || core="$LOG4J_VERSION_FALLBACK"
  # The SLF4J 1.x binding ships only in Kafka's tarball; without it the broker logs nothing.
  write_pom "$work" "<dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>$core</version></dependency>"
  mvn -q -B -C -f "$work/pom.xml" dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$KAFKA_CACHE_DIR/libs" >"$work/mvn.log" 2>&1 || { cat "$work/mvn.log" >&2; die "maven resolution failed"; }
  # Both SLF4J bindings must not be on the path at once.
  rm -f "$KAFKA_CACHE_DIR"/libs/log4j-slf4j2-impl-*.jar
  touch "$KAFKA_CACHE_DIR/.complete"
  rm -rf "$work"
}

# The brokers' logging, written at each start so that a cache installed by an older script takes
# a change. WARN and up, plus the start-up phases of a node (the controller's, then the broker's:
# metadata catch-up, which takes in loading its logs, and unfencing): a broker slow to come back
# says where it waits.
write_log_config() {
  local want
  want="$(cat <<'EOF'
Configuration:
  Properties:
    Property:
      - name: "logfile"
        value: "${sys:kafka.logs.dir}/server.log"
  Appenders:
    File:
      name: FILE
      fileName: "${logfile}"
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: WARN
      AppenderRef:
        - ref: FILE
    Logger:
      - name: kafka.server.KafkaServer
        level: INFO
      - name: kafka.Kafka
        level: INFO
      - name: kafka.server.ControllerServer
        level: INFO
      - name: kafka.server.BrokerServer
        level: INFO
      - name: kafka.server.BrokerLifecycleManager
        level: INFO
EOF
)"
  if [[ "$(cat "$KAFKA_CACHE_DIR/log4j2.yaml" 2>/dev/null)" != "$want" ]]; then
    # Renamed into place: a broker of another setup starting meanwhile reads the old file or
    # the new one, never a half-written one.
    printf '%s\n' "$want" >"$KAFKA_CACHE_DIR/log4j2.yaml.$$"
    mv -f "$KAFKA_CACHE_DIR/log4j2.yaml.$$" "$KAFKA_CACHE_DIR/log4j2.yaml"
  fi
}

write_pom() {
  cat >"$1/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.streaming-hub</groupId><artifactId>kafka-runtime</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$KAFKA_VERSION</version></dependency>
    $2
  </dependencies>
</project>
EOF
}

java_cmd() {
  # $1 = node id; remaining args passed to java
  local node="$1"; shift
  java -Xms128m -Xmx"$KAFKA_HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    -Dkafka.logs.dir="$(node_dir "$node")/logs" \
    -Dlog4j2.configurationFile="$KAFKA_CACHE_DIR/log4j2.yaml" \
    -cp "$KAFKA_CACHE_DIR/libs/*" "$@"
}

# A CA and a server certificate for 127.0.0.1/localhost under $KAFKA_DATA_DIR/tls (made once):
# ca.pem is what clients trust, server.pem (PKCS#8 key + certificate) the broker's PEM keystore.
make_tls() {
  local tls="$KAFKA_DATA_DIR/tls"
  [[ -f "$tls/server.pem" ]] && return 0
  command -v openssl >/dev/null || die "--sasl needs openssl to make the TLS certificate"
  mkdir -p "$tls"
  (
    cd "$tls"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=streaming-hub test CA" \
      -keyout ca.key -out ca.pem
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.crt
    openssl pkcs8 -topk8 -nocrypt -in server.key -out server.pk8
    cat server.pk8 server.crt >server.pem
  ) >"$KAFKA_DATA_DIR/tls.log" 2>&1 || { cat "$KAFKA_DATA_DIR/tls.log" >&2; die "making the TLS certificate failed"; }
}

write_config() {
  local node="$1" brokers="$2" sasl="${3:-0}" dir; dir="$(node_dir "$node")"
  mkdir -p "$dir/data" "$dir/logs"
  local rf=1 minisr=1 quorum i
  if [[ "$brokers" -gt 1 ]]; then rf=3; minisr=2; fi
  quorum=""
  for ((i = 1; i <= brokers; i++)); do quorum+="${quorum:+,}$i@127.0.0.1:$(controller_port "$i")"; done
  local listeners="PLAINTEXT://127.0.0.1:$(client_port "$node"),CONTROLLER://127.0.0.1:$(controller_port "$node")"
  local protocols="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
  if [[ $sasl == 1 ]]; then
    listeners+=",SASL_PLAINTEXT://127.0.0.1:$KAFKA_SASL_PORT,SASL_SSL://127.0.0.1:$((KAFKA_SASL_PORT + 1))"
    protocols+=",SASL_PLAINTEXT:SASL_PLAINTEXT,SASL_SSL:SASL_SSL"
  fi
  cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$node
controller.quorum.voters=$quorum
listeners=$listeners
advertised.listeners=$listeners
controller.listener.names=CONTROLLER
listener.security.protocol.map=$protocols
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=$rf
min.insync.replicas=$minisr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$minisr
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$minisr
group.initial.rebalance.delay.ms=0
group.consumer.min.session.timeout.ms=2000
group.classic.min.session.timeout.ms=2000
auto.create.topics.enable=false
log.cleaner.backoff.ms=500
log.cleaner.dedupe.buffer.size=4194304
log.cleaner.threads=1
log.segment.bytes=16777216
num.network.threads=2
num.io.threads=4
EOF
  if [[ -n ${KAFKA_EXTRA_CONFIG:-} ]]; then
    printf '%s\n' "$KAFKA_EXTRA_CONFIG" >>"$dir/server.properties"
  fi
  if [[ $sasl == 1 ]]; then
    # SCRAM-SHA-256 on both SASL listeners; the credentials live in the cluster metadata (made at
    # format time), so the server side needs only the login module.
    cat >>"$dir/server.properties" <<EOF
sasl.enabled.mechanisms=SCRAM-SHA-256
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PEM
ssl.keystore.location=$KAFKA_DATA_DIR/tls/server.pem
EOF
  fi
}

# Sends a Metadata v4 request and succeeds when the answer lists at least $2 brokers.
metadata_ok() {
  python3 - "$1" "$2" <<'EOF' 2>/dev/null
import socket, struct, sys
port, want = int(sys.argv[1]), int(sys.argv[2])
cid = b"kafka.sh"
body = struct.pack(">hhih", 3, 4, 1, len(cid)) + cid + struct.pack(">i", -1) + b"\x00"
s = socket.create_connection(("127.0.0.1", port), timeout=2)
s.sendall(struct.pack(">i", len(body)) + body)
def recv(n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise SystemExit(1)
        buf += chunk
    return buf
size = struct.unpack(">i", recv(4))[0]
resp = recv(size)
corr, throttle, nbrokers = struct.unpack(">iii", resp[:12])
sys.exit(0 if corr == 1 and nbrokers >= want else 1)
EOF
}

# True when node $1's pid file names a live process that is this node's broker. A pid file left
# behind by a machine that stopped without `stop` may name a pid reused by an unrelated process,
# so the command line must mention this node's config file.
node_alive() {
  local dir pidf pid; dir="$(node_dir "$1")"; pidf="$dir/kafka.pid"
  [[ -f "$pidf" ]] || return 1
  pid="$(cat "$pidf")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$dir/server.properties"
}

running_nodes() {
  local n=0 d
  for d in "$KAFKA_DATA_DIR"/node-*; do
    [[ -d "$d" ]] || continue
    if node_alive "${d##*/node-}"; then n=$((n + 1)); fi
  done
  echo "$n"
}

start_node() {
  local node="$1" dir; dir="$(node_dir "$node")"
  if node_alive "$node"; then return 0; fi
  rm -f "$dir/kafka.pid"
  nohup java -Xms128m -Xmx"$KAFKA_HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    -Dkafka.logs.dir="$dir/logs" -Dlog4j2.configurationFile="$KAFKA_CACHE_DIR/log4j2.yaml" \
    -cp "$KAFKA_CACHE_DIR/libs/*" kafka.Kafka "$dir/server.properties" \
    >"$dir/logs/stdout.log" 2>&1 </dev/null &
  echo $! >"$dir/kafka.pid"
}

wait_ready() {
  local brokers="$1" deadline=$((SECONDS + 90)) i
  while ((SECONDS < deadline)); do
    # Our own processes first: an answer on the port from a broker that is not ours (one that
    # outlived its pid file) must not pass for this start.
    for ((i = 1; i <= brokers; i++)); do
      local pidf; pidf="$(node_dir "$i")/kafka.pid"
      if [[ -f "$pidf" ]] && ! kill -0 "$(cat "$pidf")" 2>/dev/null; then
        tail -n 40 "$(node_dir "$i")/logs/stdout.log" "$(node_dir "$i")/logs/server.log" >&2 2>/dev/null || true
        die "broker $i exited during start-up (logs in $(node_dir "$i")/logs)"
      fi
    done
    if metadata_ok "$KAFKA_PORT" "$brokers"; then return 0; fi
    sleep 0.3
  done
  die "broker did not answer a metadata request within 90 s"
}

bootstrap_list() {
  local brokers="$1" out="" i
  for ((i = 1; i <= brokers; i++)); do out+="${out:+,}127.0.0.1:$(client_port "$i")"; done
  echo "$out"
}

cmd_start() {
  local brokers=1 fresh=0 sasl=0 i
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --brokers) brokers="$2"; shift 2 ;;
      --fresh) fresh=1; shift ;;
      --sasl) sasl=1; shift ;;
      *) die "unknown option $1" ;;
    esac
  done
  [[ "$brokers" == 1 || "$brokers" == 3 ]] || die "--brokers must be 1 or 3"
  [[ $sasl == 0 || "$brokers" == 1 ]] || die "--sasl runs one broker only"
  # The shape of a setup: broker count, plus "+sasl" when it has the SASL listeners.
  local shape="$brokers"; [[ $sasl == 1 ]] && shape+="+sasl"
  if [[ -f "$KAFKA_DATA_DIR/brokers" && "$(running_nodes)" -gt 0 ]]; then
    local have; have="$(cat "$KAFKA_DATA_DIR/brokers")"
    [[ "$have" == "$shape" ]] || die "a $have-broker setup is running in $KAFKA_DATA_DIR; stop it first"
    if metadata_ok "$KAFKA_PORT" "$brokers"; then
      log "already running ($(bootstrap_list "$brokers"))"; echo "$(bootstrap_list "$brokers")"; return 0
    fi
  fi
  install_kafka
  write_log_config
  if [[ "$(running_nodes)" -eq 0 ]]; then
    # Nothing of ours runs: a port in use is someone else's broker (or any server), and its
    # answers would pass for ours.
    for ((i = 1; i <= brokers; i++)); do
      local port
      for port in "$(client_port "$i")" "$(controller_port "$i")"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
          die "port $port is in use by a process this script did not start (KAFKA_PORT=$KAFKA_PORT): stop it or pick another KAFKA_PORT"
        fi
      done
    done
  fi
  if [[ $fresh == 1 && "$(running_nodes)" -eq 0 && -d "$KAFKA_DATA_DIR" ]]; then
    log "--fresh: removing the storage in $KAFKA_DATA_DIR"
    rm -rf "$KAFKA_DATA_DIR"
  fi
  if [[ -f "$KAFKA_DATA_DIR/brokers" && "$(cat "$KAFKA_DATA_DIR/brokers")" != "$shape" ]]; then
    rm -rf "$KAFKA_DATA_DIR" # a different cluster shape needs fresh storage
  fi
  mkdir -p "$KAFKA_DATA_DIR"
  echo "$shape" >"$KAFKA_DATA_DIR/brokers"
  local cluster_id_file="$KAFKA_DATA_DIR/cluster.id"
  if [[ ! -s "$cluster_id_file" ]]; then
    local id
    id="$(java_cmd 1 kafka.tools.StorageTool random-uuid 2>"$KAFKA_DATA_DIR/random-uuid.log" | tail -1)" || id=""
    [[ -n "$id" ]] || { cat "$KAFKA_DATA_DIR/random-uuid.log" >&2; die "could not make a cluster id"; }
    echo "$id" >"$cluster_id_file"
  fi
  local scram=()
  if [[ $sasl == 1 ]]; then
    make_tls
    scram=(--add-scram "SCRAM-SHA-256=[name=$KAFKA_SASL_USER,password=$KAFKA_SASL_PASSWORD]")
  fi
  for ((i = 1; i <= brokers; i++)); do
    write_config "$i" "$brokers" "$sasl"
    java_cmd "$i" kafka.tools.StorageTool format --ignore-formatted -t "$(cat "$cluster_id_file")" \
      -c "$(node_dir "$i")/server.properties" "${scram[@]}" >"$(node_dir "$i")/logs/format.log" 2>&1 \
      || { cat "$(node_dir "$i")/logs/format.log" >&2; die "storage format failed"; }
  done
  local t0=$SECONDS
  for ((i = 1; i <= brokers; i++)); do start_node "$i"; done
  wait_ready "$brokers"
  log "ready in $((SECONDS - t0)) s: $(bootstrap_list "$brokers")"
  if [[ $sasl == 1 ]]; then
    log "SCRAM-SHA-256 user $KAFKA_SASL_USER: SASL_PLAINTEXT 127.0.0.1:$KAFKA_SASL_PORT," \
      "SASL_SSL 127.0.0.1:$((KAFKA_SASL_PORT + 1)) (CA $KAFKA_DATA_DIR/tls/ca.pem)"
  fi
  bootstrap_list "$brokers"
}

cmd_stop() {
  local any=0 d node pids=()
  for d in "$KAFKA_DATA_DIR"/node-*; do
    [[ -d "$d" ]] || continue
    node="${d##*/node-}"
    if node_alive "$node"; then
      # The process may end between the check and the kill: that is a stop too.
      pids+=("$(cat "$d/kafka.pid")"); kill "${pids[-1]}" 2>/dev/null || true; any=1
    fi
  done
  local deadline=$((SECONDS + 30)) pid
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  done
  # Only once the processes are gone: a stop cut short leaves the pid files that name them.
  for d in "$KAFKA_DATA_DIR"/node-*; do
    [[ -d "$d" ]] && rm -f "$d/kafka.pid"
  done
  [[ $any == 1 ]] && log "stopped" || log "not running"
}

cmd_status() {
  local n; n="$(running_nodes)"
  if [[ "$n" -gt 0 ]] && metadata_ok "$KAFKA_PORT" 1; then
    local shape; shape="$(cat "$KAFKA_DATA_DIR/brokers")"
    echo "running: $n broker(s), bootstrap $(bootstrap_list "${shape%%+*}")"
    return 0
  fi
  echo "not running"; return 1
}

cmd_kill() {
  local pidf; pidf="$(node_dir "$1")/kafka.pid"
  node_alive "$1" || die "node $1 is not running"
  local pid; pid="$(cat "$pidf")"
  kill -9 "$pid" 2>/dev/null || true
  # Gone before its pid file is: a restart-node right after must not start a second JVM on the
  # same data directory.
  local deadline=$((SECONDS + 30))
  while kill -0 "$pid" 2>/dev/null; do
    ((SECONDS < deadline)) || die "node $1 (pid $pid) did not exit after SIGKILL"
    sleep 0.1
  done
  rm -f "$pidf"
}

cmd_restart_node() {
  write_log_config
  start_node "$1"
  # A broker killed under load recovers its logs, catches up with the metadata and waits to be
  # unfenced before its port answers: seconds on a quiet machine, longer on a busy one.
  local started=$SECONDS deadline=$((SECONDS + ${KAFKA_RESTART_TIMEOUT_S:-180}))
  until metadata_ok "$(client_port "$1")" 1; do
    if ! node_alive "$1"; then
      tail -n 40 "$(node_dir "$1")/logs/stdout.log" "$(node_dir "$1")/logs/server.log" >&2 2>/dev/null || true
      die "node $1 exited while restarting (logs in $(node_dir "$1")/logs)"
    fi
    if ((SECONDS >= deadline)); then
      tail -n 60 "$(node_dir "$1")/logs/server.log" >&2 2>/dev/null || true
      die "node $1 did not come back within $((SECONDS - started)) s (logs in $(node_dir "$1")/logs)"
    fi
    sleep 0.3
  done
  log "node $1 back after $((SECONDS - started)) s"
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  kill) cmd_kill "$2" ;;
  restart-node) cmd_restart_node "$2" ;;
  install) install_kafka ;;
  *) echo "usage: $0 start [--brokers 1|3] [--fresh] [--sasl] | stop | status | kill <node> | restart-node <node>" >&2; exit 2 ;;
esac
