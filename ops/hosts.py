"""Host configuration: who to connect to and how the host is laid out.

Owns parsing and validation of `HOST=user@host[:port]`, of the special name `local`, and of the hosts
file (TOML, `[hosts.NAME]` tables), and the server strategy grammar. Everything is checked up front, so a
command never starts with a half-valid configuration. Does not connect (connection.py) and does not read
~/.ssh/config itself: Fabric does that when the connection is made.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from ops.errors import ConfigError
from ops.layout import AUTO, BACKENDS, Layout
from ops.trainsplit import TrainStates, train_from_table

DEFAULT_PROTECTED = ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter", "Xorg")
HOSTS_FILE_ENV = "EAGLE_OPS_HOSTS"
DEFAULT_HOSTS_FILES = (Path("hosts.toml"), Path("~/.config/eagle-ops/hosts.toml"))
LOCAL = "local"

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_SPEC = re.compile(rf"^(?:(?P<user>{_NAME})@)?(?P<host>{_NAME}|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]+))?$")
# a host name (IPv6 addresses included) or a run id: one safe path component, never "." or ".."
_LABEL = {
    True: re.compile(r"^[A-Za-z0-9:][A-Za-z0-9._:-]{0,99}$"),
    False: re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"),
}
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: anything longer is a typo, and inf/NaN would never return
_CONTAINER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # docker's own rule for container names
_UNIT = re.compile(r"^[A-Za-z0-9:_.@\\-]+$")


@dataclass(frozen=True)
class Strategy:
    """How the inference server is stopped and brought back: one of
    `compose:PROJECT/SERVICE`, `container:NAME`, `systemd:UNIT`, `pidfile:PATH`, `none`."""

    kind: str  # compose | container | systemd | pidfile | none
    target: str = ""  # the NAME/UNIT/PATH, or "PROJECT/SERVICE"

    @property
    def project(self) -> str:
        return self.target.split("/", 1)[0]

    @property
    def service(self) -> str:
        return self.target.split("/", 1)[1]

    def __str__(self) -> str:
        return self.kind if self.kind == "none" else f"{self.kind}:{self.target}"


def parse_strategy(text: str) -> Strategy:
    """Parse a strategy string; raise ConfigError naming the accepted forms."""
    forms = "compose:PROJECT/SERVICE, container:NAME, systemd:UNIT, pidfile:/ABS/PATH or none"
    text = text.strip()
    if text == "none":
        return Strategy("none")
    kind, sep, target = text.partition(":")
    if not sep or not target:
        raise ConfigError(f"server strategy {text!r} is malformed; use one of {forms}")
    if kind == "container" and _CONTAINER.match(target):
        return Strategy(kind, target)
    if kind == "compose":
        project, slash, service = target.partition("/")
        if slash and _CONTAINER.match(project) and _CONTAINER.match(service):
            return Strategy(kind, target)
    if kind == "systemd" and _UNIT.match(target):
        return Strategy(kind, target)
    if kind == "pidfile" and target.startswith("/") and "\0" not in target:
        return Strategy(kind, target)
    raise ConfigError(f"server strategy {text!r} is malformed; use one of {forms}")


@dataclass(frozen=True)
class Timeouts:
    """Seconds allowed for each kind of wait."""

    connect: float = 10.0  #: TCP + SSH handshake
    command: float = 120.0  #: one ordinary remote command
    grace: float = 10.0  #: between SIGTERM and SIGKILL of a GPU holder
    kill_wait: float = 5.0  #: after SIGKILL, before a survivor is declared unkillable
    stop: float = 60.0  #: graceful server stop (docker stop --time, systemctl stop, pidfile TERM)
    clean: float = 60.0  #: verify-clean retries until this many seconds
    lock_expire: float = 60.0  #: a host lock whose ops process sent no heartbeat for this long is released


@dataclass(frozen=True)
class HostConfig:
    """Everything ops needs to know about one GPU host. Field docs are the hosts-file keys."""

    name: str  #: the label used for runs/<name>/ and messages
    host: str  #: address to connect to, or "local" (run on this machine, no SSH)
    user: str | None = None  #: SSH user (default: ~/.ssh/config, then the local user)
    port: int | None = None  #: SSH port (default: ~/.ssh/config, then 22)
    key: str | None = None  #: private key file (default: ~/.ssh/config / agent / default keys)
    known_hosts: str | None = (
        None  #: known_hosts file (default: ssh config UserKnownHostsFile, ~/.ssh/known_hosts)
    )
    data_root: str = "/data/eagle"  #: host folder mounted at /data in the stage container
    model_dir: str = "/models/target"  #: host folder with the target model, mounted read-only at /model
    cache_dir: str = "/data/eagle/cache"  #: host folder mounted at /cache (HF cache, compile caches)
    image: str = "eagle-ops:latest"  #: image reference the stages run in
    server: Strategy = field(default_factory=lambda: Strategy("none"))  #: inference server stop strategy
    server_start: tuple[str, ...] = ()  #: argv that starts the server again (pidfile strategy only)
    #: the server's OpenAI-compatible URL as the host itself reaches it (a server-up stage, regenerate, runs
    #: on the host's network and asks it there: `--endpoint`)
    server_endpoint: str = "http://127.0.0.1:8000/v1"
    #: the name the server serves the target under (`--served-model`); None: the one model it lists
    served_model: str | None = None
    protected: tuple[str, ...] = DEFAULT_PROTECTED  #: process names never killed
    clean_threshold_mib: int = 1024  #: a GPU counts as clean below this used memory (NVML v2, no process)
    device_glob: str = "/dev/nvidia*"  #: files whose holders are GPU users (fuser)
    gpu_source: str = "nvml"  #: "nvml", or "table:/host/path.json" (a process table in the probe's format)
    python: str = "python3"  #: the host's interpreter that runs the probe (stdlib only)
    docker_gpus: str = "all"  #: value of `docker run --gpus`; "" for hosts without the NVIDIA runtime
    mounts: tuple[str, ...] = ()  #: extra `docker run -v` specs for the stage container
    secrets: tuple[str, ...] = ("HF_TOKEN",)  #: variables of the operator's environment passed to the stage
    #: container through a 0600 env file (never argv); unset ones are skipped with a preflight warning
    secrets_dir: str = "/dev/shm"  #: host folder (tmpfs: never on disk) for that env file during `docker run`
    stage_user: str = "auto"  #: stage container user: "auto" (owner of data_root), "root", or "UID[:GID]"
    stage_read_only: bool = True  #: read-only root file system (private /tmp, HOME=/cache/home)
    stage_pids_limit: int = 16384  #: `--pids-limit` of the stage container (threads count too); 0: none
    stage_ipc: str = "private"  #: "private" (own IPC namespace, /dev/shm of stage_shm_size) or "host"
    stage_shm_size: str = "16g"  #: /dev/shm size when stage_ipc is private (NCCL, vLLM message queues)
    lock_file: str = "/run/lock/eagle-ops.lock"  #: the host lock (flock) every changing ops command holds
    backend: str = AUTO  #: extract's backend: "auto" (contract/backends.py's rule), "vllm" or "hf"
    tensor_parallel_size: int = 0  #: vllm backend: GPUs per model replica; 0 = all GPUs of the host
    data_parallel: int = 0  #: hf backend: processes, one GPU each; 0 = one per GPU (vllm: 1)
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: `[hosts.NAME.train]`: train's states mode, budget and the producer/trainer GPU split (ops.trainsplit)
    train: TrainStates = field(default_factory=TrainStates)

    @property
    def is_local(self) -> bool:
        return self.host == LOCAL

    @property
    def layout(self) -> Layout:
        return Layout(self.backend, self.tensor_parallel_size, self.data_parallel)


_KEYS = {f.name for f in fields(HostConfig)} - {"name"}


def parse_host_spec(spec: str) -> HostConfig:
    """`user@host[:port]`, `host`, or `local` -> HostConfig with defaults for everything else."""
    if spec == LOCAL:
        return HostConfig(name=LOCAL, host=LOCAL)
    m = _SPEC.match(spec)
    if not m:
        raise ConfigError(f"host {spec!r} is neither user@host[:port] nor a name from the hosts file")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"port {port} in {spec!r} is out of range 1-65535")
    host = m["host"].strip("[]")
    return HostConfig(name=host, host=host, user=m["user"], port=port)


def check_label(text: str, what: str, *, host: bool = False) -> str:
    """A host name or run id used as a folder under --runs-dir: 1-100 letters, digits, '.', '_' or '-' (and
    ':' in a host name, for IPv6 addresses), starting with a letter or digit: never '.', '..' or a path."""
    if not isinstance(text, str) or not _LABEL[host].match(text):
        extra = ", ':'" if host else ""
        raise ConfigError(
            f"{what} {text!r} must be 1-100 letters, digits, '.', '_', '-'{extra}, starting with a "
            "letter or digit (it names a folder under --runs-dir)"
        )
    return text


def check_seconds(value: object, what: str) -> float:
    """A timeout: a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0 < value <= MAX_TIMEOUT_S:
        raise ConfigError(
            f"{what} must be a positive number of seconds up to {MAX_TIMEOUT_S:g} (a week), got {value!r}"
        )
    return float(value)


def _str(value: object, key: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {key} must be a non-empty string")
    if "\0" in value or "\n" in value:
        raise ConfigError(f"{where}: {key} contains a NUL or newline")
    return value


def _abs(value: object, key: str, where: str) -> str:
    text = _str(value, key, where)
    if not text.startswith("/"):
        raise ConfigError(f"{where}: {key} must be an absolute path on the host, got {text!r}")
    return text


def host_from_table(name: str, table: dict, where: str) -> HostConfig:
    """Validate one `[hosts.NAME]` table."""
    unknown = sorted(set(table) - _KEYS - {"address"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    base = parse_host_spec(_str(table["address"], "address", where)) if "address" in table else None
    if base is None and "host" not in table:
        raise ConfigError(f'{where}: give `address = "user@host[:port]"` or `host = ...`')
    kw: dict = {}
    if base is not None:
        kw.update(host=base.host, user=base.user, port=base.port)
    for key in ("host", "user", "key", "known_hosts", "image", "gpu_source", "python", "device_glob"):
        if key in table:
            kw[key] = _str(table[key], key, where)
    if "docker_gpus" in table:
        if not isinstance(table["docker_gpus"], str):
            raise ConfigError(f"{where}: docker_gpus must be a string")
        kw["docker_gpus"] = table["docker_gpus"]
    for key in ("data_root", "model_dir", "cache_dir", "lock_file"):
        if key in table:
            kw[key] = _abs(table[key], key, where)
    if "port" in table:
        port = table["port"]
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"{where}: port must be an integer 1-65535, got {port!r}")
        kw["port"] = port
    if "server" in table:
        kw["server"] = parse_strategy(_str(table["server"], "server", where))
    for key in ("server_start", "protected", "mounts"):
        if key in table:
            items = table[key]
            if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
                raise ConfigError(f"{where}: {key} must be a list of non-empty strings")
            kw[key] = tuple(items)
    if "clean_threshold_mib" in table:
        value = table["clean_threshold_mib"]
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: clean_threshold_mib must be a non-negative integer")
        kw["clean_threshold_mib"] = value
    if "timeouts" in table:
        kw["timeouts"] = _timeouts(table["timeouts"], where)
    if "train" in table:
        kw["train"] = train_from_table(table["train"], where)
    kw.update(_stage_keys(table, where))
    kw.update(_layout_keys(table, where))
    gpu_source = kw.get("gpu_source", "nvml")
    if gpu_source != "nvml" and not (gpu_source.startswith("table:/")):
        raise ConfigError(f"{where}: gpu_source must be 'nvml' or 'table:/ABS/PATH.json', got {gpu_source!r}")
    for spec in kw.get("mounts", ()):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0].startswith("/") or not parts[1].startswith("/"):
            raise ConfigError(f"{where}: mount {spec!r} must be /host/path:/container/path[:ro]")
    return HostConfig(name=name, **kw)


_USER = re.compile(r"^(auto|root|[0-9]+(:[0-9]+)?)$")
_SIZE = re.compile(r"^[0-9]+[bkmg]?$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_URL = re.compile(r"^https?://[^\s/?#@]+(/[^\s?#]*)?$")
_SERVED = re.compile(r"^[^\s\x00-\x1f]{1,200}$")


def _stage_keys(table: dict, where: str) -> dict:
    """The stage container's secrets and privileges, and the server a server-up stage asks (see
    HostConfig)."""
    kw: dict = {}
    if "secrets" in table:
        names = table["secrets"]
        if not isinstance(names, list) or not all(isinstance(n, str) and _ENV.match(n) for n in names):
            raise ConfigError(
                f"{where}: secrets must be a list of environment variable names (names, not values)"
            )
        kw["secrets"] = tuple(names)
    if "secrets_dir" in table:
        kw["secrets_dir"] = _abs(table["secrets_dir"], "secrets_dir", where)
    checks = (
        ("stage_user", _USER, "auto, root or UID[:GID]"),
        ("stage_ipc", re.compile(r"^(private|host)$"), "private or host"),
        ("stage_shm_size", _SIZE, "a size like 16g"),
        (
            "server_endpoint",
            _URL,
            "an http(s) URL without credentials or query, like http://127.0.0.1:8000/v1",
        ),
        ("served_model", _SERVED, "the server's model name (1-200 characters, no spaces)"),
    )
    for key, rule, what in checks:
        if key in table:
            if not isinstance(table[key], str) or not rule.match(table[key]):
                raise ConfigError(f"{where}: {key} must be {what}, got {table[key]!r}")
            kw[key] = table[key]
    if "stage_read_only" in table:
        if not isinstance(table["stage_read_only"], bool):
            raise ConfigError(f"{where}: stage_read_only must be true or false")
        kw["stage_read_only"] = table["stage_read_only"]
    if "stage_pids_limit" in table:
        value = table["stage_pids_limit"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}: stage_pids_limit must be a non-negative integer (0: no limit)")
        kw["stage_pids_limit"] = value
    return kw


def _layout_keys(table: dict, where: str) -> dict:
    """backend, tensor_parallel_size, data_parallel (ops.layout)."""
    kw: dict = {}
    if "backend" in table:
        if table["backend"] not in (AUTO, *BACKENDS):
            raise ConfigError(
                f"{where}: backend must be one of {AUTO}, {', '.join(BACKENDS)}, got {table['backend']!r}"
            )
        kw["backend"] = table["backend"]
    for key in ("tensor_parallel_size", "data_parallel"):
        if key in table:
            value = table[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}: {key} must be a non-negative integer (0: auto), got {value!r}")
            kw[key] = value
    return kw


def _timeouts(table: object, where: str) -> Timeouts:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: timeouts must be a table")
    known = {f.name for f in fields(Timeouts)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown timeout(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return Timeouts(**{k: check_seconds(v, f"{where}: timeouts.{k}") for k, v in table.items()})


def find_hosts_file(explicit: str | None) -> Path | None:
    """The hosts file to use: --hosts-file, $EAGLE_OPS_HOSTS, ./hosts.toml, ~/.config/eagle-ops/hosts.toml."""
    if explicit:
        path = Path(explicit).expanduser()
        if not _is_file(path, f"hosts file {path}"):
            raise ConfigError(f"hosts file {path} does not exist")
        return path
    env = os.environ.get(HOSTS_FILE_ENV)
    if env:
        path = Path(env).expanduser()
        if not _is_file(path, f"{HOSTS_FILE_ENV}={env}"):
            raise ConfigError(f"{HOSTS_FILE_ENV}={env} does not exist")
        return path
    for candidate in DEFAULT_HOSTS_FILES:
        path = candidate.expanduser()
        if path.is_file():
            return path
    return None


def _is_file(path: Path, what: str) -> bool:
    """Whether ``path`` is a file; a path the kernel cannot walk (a symlink loop, a name too long, a
    component that is a file) is one line naming it, never the OSError pathlib raises for some of these."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ConfigError(f"{what}: {exc.strerror or exc}; pass a hosts file that exists") from None
    return path.is_file()


def load_hosts_file(path: Path) -> dict[str, HostConfig]:
    """Parse and validate every host of a hosts file."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"hosts file {path}: not UTF-8 text (byte {exc.start}); TOML is UTF-8") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"hosts file {path}: {exc}") from None
    hosts = data.get("hosts", {})
    if not isinstance(hosts, dict) or set(data) - {"hosts"}:
        raise ConfigError(f"hosts file {path}: expected only [hosts.NAME] tables")
    out = {}
    for name, table in hosts.items():
        if not isinstance(table, dict):
            raise ConfigError(f"hosts file {path}: hosts.{name} must be a table")
        check_label(name, f"hosts file {path}: host name", host=True)
        where = f"{path} [hosts.{name}]"
        try:
            out[name] = host_from_table(name, table, where)
        except ConfigError as exc:  # a value's own check (an address, a strategy) may not say where it is
            if str(path) in str(exc):
                raise
            raise ConfigError(f"{where}: {exc}") from None
    return out


def resolve_host(spec: str, hosts_file: str | None = None) -> HostConfig:
    """A name from the hosts file wins; otherwise `user@host[:port]` or `local`."""
    if not spec:
        raise ConfigError("no host given; pass --host NAME|user@host[:port] (make: HOST=...)")
    path = find_hosts_file(hosts_file)
    if path is not None:
        hosts = load_hosts_file(path)
        if spec in hosts:
            return hosts[spec]
    return parse_host_spec(spec)
