"""Host specs, hosts files and server strategies are validated up front with one-line errors."""

from __future__ import annotations

import pytest

from ops_helpers import write_hosts
from ops.errors import ConfigError
from ops.hosts import HostConfig, Strategy, load_hosts_file, parse_host_spec, parse_strategy, resolve_host


@pytest.mark.parametrize(
    "spec, host, user, port",
    [
        ("gpu-box", "gpu-box", None, None),
        ("ubuntu@10.0.0.5:2222", "10.0.0.5", "ubuntu", 2222),
        ("me@[::1]:22", "::1", "me", 22),
    ],
)
def test_host_spec_forms(spec, host, user, port):
    """user@host[:port] parses into its parts; missing parts stay None for ~/.ssh/config to fill."""
    cfg = parse_host_spec(spec)
    assert (cfg.host, cfg.user, cfg.port) == (host, user, port)


@pytest.mark.parametrize("spec", ["a b", "user@", "host:99999", "host:0", "$(reboot)", "u@h;rm -rf /", ""])
def test_bad_host_specs(spec):
    """Malformed host specs (spaces, metacharacters, bad ports) are refused."""
    with pytest.raises(ConfigError):
        resolve_host(spec, None) if spec == "" else parse_host_spec(spec)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("none", Strategy("none")),
        ("container:vllm", Strategy("container", "vllm")),
        ("compose:infer/vllm-server", Strategy("compose", "infer/vllm-server")),
        ("systemd:vllm@0.service", Strategy("systemd", "vllm@0.service")),
        ("pidfile:/run/vllm.pid", Strategy("pidfile", "/run/vllm.pid")),
    ],
)
def test_strategies(text, expected):
    """Each documented strategy form parses to its kind and target."""
    assert parse_strategy(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "docker:vllm",
        "container:",
        "compose:onlyproject",
        "pidfile:relative.pid",
        "container:a;b",
        "systemd:$(id)",
        "kill-everything",
    ],
)
def test_malformed_strategies(text):
    """Unknown kinds, missing targets and metacharacters give an error listing the accepted forms."""
    with pytest.raises(ConfigError, match="compose:PROJECT/SERVICE"):
        parse_strategy(text)


def test_hosts_file_full_table(tmp_path):
    """Every key of a hosts-file table lands in the config; the address form fills user/host/port."""
    path = write_hosts(
        tmp_path / "h.toml",
        "box",
        address="ops@box.example:2200",
        key="~/.ssh/k",
        data_root="/srv/data",
        model_dir="/srv/model",
        image="reg/img:1",
        server="container:vllm",
        protected=["Xorg"],
        clean_threshold_mib=512,
        device_glob="/tmp/dev/nvidia*",
        timeouts={"grace": 3, "clean": 30},
    )
    cfg = load_hosts_file(path)["box"]
    assert (cfg.user, cfg.host, cfg.port) == ("ops", "box.example", 2200)
    assert cfg.server == Strategy("container", "vllm") and cfg.protected == ("Xorg",)
    assert cfg.timeouts.grace == 3 and cfg.timeouts.clean == 30 and cfg.timeouts.stop == 60
    assert resolve_host("box", str(path)) == cfg


def test_stage_security_keys(tmp_path):
    """Secrets (names) and the stage container's privilege keys are read from the hosts file; the defaults
    are HF_TOKEN, /dev/shm, auto user, read-only root, 16384 pids, private IPC with 16g /dev/shm."""
    default = HostConfig(name="d", host="d")
    assert (
        default.secrets,
        default.secrets_dir,
        default.stage_user,
        default.stage_read_only,
        default.stage_pids_limit,
        default.stage_ipc,
        default.stage_shm_size,
    ) == (("HF_TOKEN",), "/dev/shm", "auto", True, 16384, "private", "16g")
    path = write_hosts(
        tmp_path / "h.toml",
        "box",
        host="h",
        secrets=["HF_TOKEN", "WANDB_API_KEY"],
        secrets_dir="/run/x",
        stage_user="1000:1000",
        stage_read_only=False,
        stage_pids_limit=0,
        stage_ipc="host",
        stage_shm_size="64g",
    )
    cfg = load_hosts_file(path)["box"]
    assert (
        cfg.secrets,
        cfg.secrets_dir,
        cfg.stage_user,
        cfg.stage_read_only,
        cfg.stage_pids_limit,
        cfg.stage_ipc,
        cfg.stage_shm_size,
    ) == (("HF_TOKEN", "WANDB_API_KEY"), "/run/x", "1000:1000", False, 0, "host", "64g")


@pytest.mark.parametrize(
    "table, message",
    [
        ({"host": "h", "colour": "red"}, "unknown key"),
        ({"host": "h", "port": "22"}, "port must be"),
        ({"host": "h", "data_root": "rel/dir"}, "absolute path"),
        ({"host": "h", "server": "docker:x"}, "malformed"),
        ({"host": "h", "timeouts": {"grace": -1}}, "positive"),
        ({"host": "h", "gpu_source": "fake"}, "gpu_source"),
        ({"user": "u"}, "address"),
        ({"host": "h", "mounts": ["rel:/x"]}, "mount"),
        ({"host": "h", "secrets": ["HF_TOKEN=hf_x"]}, "names, not values"),
        ({"host": "h", "secrets_dir": "shm"}, "absolute"),
        ({"host": "h", "stage_user": "alice"}, "stage_user"),
        ({"host": "h", "stage_ipc": "none"}, "stage_ipc"),
        ({"host": "h", "stage_shm_size": "lots"}, "stage_shm_size"),
        ({"host": "h", "stage_read_only": "yes"}, "true or false"),
        ({"host": "h", "stage_pids_limit": -1}, "stage_pids_limit"),
        ({"host": "h", "lock_file": "eagle.lock"}, "lock_file must be an absolute path"),
        ({"host": "h", "timeouts": {"lock_expire": 0}}, "lock_expire must be a positive"),
    ],
)
def test_bad_hosts_tables(tmp_path, table, message):
    """Each invalid hosts-file value is named in the error."""
    path = write_hosts(tmp_path / "h.toml", "box", **table)
    with pytest.raises(ConfigError, match=message):
        load_hosts_file(path)


def test_missing_hosts_file_is_an_error(tmp_path):
    """An explicit --hosts-file that does not exist is an error, not a silent fallback."""
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_host("box", str(tmp_path / "nope.toml"))


def test_cli_malformed_strategy_is_one_line(tmp_path):
    """A malformed strategy in the hosts file stops the CLI before connecting: one error line, exit 2."""
    from ops_helpers import run_ops

    path = write_hosts(tmp_path / "h.toml", "box", host="127.0.0.1", server="container:$(reboot)")
    res = run_ops("gpu-clean", "--host", "box", "--hosts-file", str(path))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "malformed" in res.stderr, res.stderr
