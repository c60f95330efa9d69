import pytest

from ps.spec.config import PsConfig
from services.config import ConfigError, load
from supervise.upconfig import UpConfig
from trainer.lm.config import TrainerConfig
from services.names import format_name, parse_name
from services.torchrun import as_worker
from services.workload import TorchrunSpec


@pytest.mark.parametrize("name", ["ps0", "ps12", "trainer3", "observer0", "agent"])
def test_valid_names_round_trip(name):
    parsed = parse_name(name)
    assert format_name(parsed.role, parsed.index) == name


@pytest.mark.parametrize("name", ["ps-1", "trainer", "agent0", "worker1", "PS0", "trainer_1", ""])
def test_invalid_names_are_refused(name):
    with pytest.raises(ValueError):
        parse_name(name)


def test_flags_win_over_environment_and_torch_variables_are_read():
    cfg = load(TrainerConfig, {"batch_size": "8"}, {"RPCPS_BATCH_SIZE": "4", "RPCPS_BPTT": "7",
                                                    "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert (cfg.batch_size, cfg.bptt, cfg.master_addr, cfg.master_port) == (8, 7, "10.0.0.5", 1234)


def test_bad_values_name_their_source():
    with pytest.raises(ConfigError) as e:
        load(TrainerConfig, {"steps": "many"}, {"RPCPS_DROPOUT": "1.5"})
    msg = str(e.value)
    assert "flag --steps" in msg and "'many'" in msg
    assert "environment variable RPCPS_DROPOUT" in msg


def test_name_must_fit_the_role_and_the_cluster():
    with pytest.raises(ConfigError, match="not a ps name"):
        load(PsConfig, {"name": "trainer0"}, {})
    # a server past --num-ps joins a running job, as a StatefulSet scaled up starts it
    assert load(PsConfig, {"name": "ps2", "num_ps": "2"}, {}).name == "ps2"
    with pytest.raises(ConfigError, match="no '-'"):
        load(TrainerConfig, {"name": "trainer-1"}, {})


def test_bad_master_port_is_refused():
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        load(PsConfig, {}, {"MASTER_PORT": "70000"})


def test_unknown_rpcps_variable_only_warns(caplog):
    cfg = load(UpConfig, {}, {"RPCPS_NOT_A_SETTING": "1", "RPCPS_JSON": "true"})
    assert cfg.as_json is True
    assert "RPCPS_NOT_A_SETTING" in caplog.text


def test_control_token_is_secret():
    cfg = load(PsConfig, {}, {"RPCPS_CONTROL_TOKEN": "s3cret"})
    assert "s3cret" not in repr(cfg) and cfg.control_token.get_secret_value() == "s3cret"


def test_rl_roles_configs_and_leaders():
    from trainer.rl.config import AgentConfig, ObserverConfig
    from services.names import leader_of
    agent = load(AgentConfig, {}, {"RPCPS_EPISODES": "5"})
    assert agent.name == "agent" and agent.episodes == 5 and str(agent.checkpoint_dir) == "checkpoints/rl"
    assert load(ObserverConfig, {"name": "observer3", "env": "fixed:10"}, {}).env == "fixed:10"
    with pytest.raises(ConfigError, match="--env"):
        load(ObserverConfig, {"env": "Pong-v5"}, {})
    with pytest.raises(ConfigError, match="not a observer name|not an observer name|observer"):
        load(ObserverConfig, {"name": "trainer0"}, {})
    assert not hasattr(agent, "num_ps")                       # the RL roles have no servers
    assert [leader_of(n) for n in ("ps1", "trainer0", "agent", "observer2")] == ["ps0", "ps0", "agent", "agent"]


def test_up_refuses_a_setting_of_the_other_workload():
    assert load(UpConfig, {"workload": "rl", "observers": "3"}, {}).observers == 3
    with pytest.raises(ConfigError, match="--num-ps: not a setting of --workload rl"):
        load(UpConfig, {"workload": "rl", "num_ps": "3"}, {})
    with pytest.raises(ConfigError, match="--episodes: not a setting of --workload lm"):
        load(UpConfig, {"workload": "lm", "episodes": "3"}, {})
    # Without --workload, settings of one workload alone choose it.
    assert load(UpConfig, {"episodes": "3"}, {}).workload == "rl"


def test_a_workload_setting_is_checked_when_up_loads_it():
    assert load(UpConfig, {"consistency": "SSP:2"}, {}).settings().consistency == "ssp:2"
    with pytest.raises(ConfigError, match=r"--consistency: consistency must be async, sync, hybrid or ssp:K .*got 'bsp'"):
        load(UpConfig, {"consistency": "bsp"}, {})
    with pytest.raises(ConfigError, match=r"flag --consistency: consistency must be .*got 'ssp:x'"):
        load(PsConfig, {"consistency": "ssp:x"}, {})


def test_ps_addr_wins_over_torch_variables_and_is_checked():
    cfg = load(TrainerConfig, {"ps_addr": "servers.example:29600"}, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (cfg.master_addr, cfg.master_port) == ("servers.example", 29600)
    assert load(TrainerConfig, {}, {"RPCPS_PS_ADDR": "[::1]:29501"}).master_addr == "::1"
    for bad in ("servers.example", "host:0", "host:port", ":29500"):
        with pytest.raises(ConfigError, match="--ps-addr / RPCPS_PS_ADDR: expected HOST:PORT"):
            load(TrainerConfig, {"ps_addr": bad}, {})


TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}
TRAINER_UNDER_TORCHRUN = TorchrunSpec("num_trainers", (("start", "true"), ("exit_when_done", "true")))


def as_trainer(flags: dict, environ: dict) -> TrainerConfig:
    return load(TrainerConfig, *as_worker("trainer", TRAINER_UNDER_TORCHRUN, flags, environ))


def test_a_trainer_under_torchrun_is_named_and_counted_by_it():
    cfg = as_trainer({"ps_addr": "ps0:29500"}, TORCHRUN)
    assert (cfg.name, cfg.num_trainers, cfg.sidecar_port) == ("trainer3", 4, 8081)   # 8080 + local rank
    assert cfg.start and cfg.exit_when_done
    assert (cfg.master_addr, cfg.master_port) == ("ps0", 29500)
    # Told otherwise, it keeps what it was told; a free sidecar port stays free.
    cfg = as_trainer({"start": False, "exit_when_done": False, "sidecar_port": "0"},
                     {**TORCHRUN, "RPCPS_PS_ADDR": "ps0:29500"})
    assert (cfg.start, cfg.exit_when_done, cfg.sidecar_port) == (False, False, 0)
    # Outside torchrun nothing changes, MASTER_ADDR included.
    cfg = as_trainer({"name": "trainer1"}, {"MASTER_ADDR": "node0", "MASTER_PORT": "29400"})
    assert (cfg.name, cfg.num_trainers, cfg.start, cfg.master_addr) == ("trainer1", 2, False, "node0")


@pytest.mark.parametrize("flags, says", [
    ({}, "say where the servers' store is with --ps-addr"),
    ({"ps_addr": "ps0:29500", "name": "trainer0"}, "torchrun names its workers: this one is trainer3"),
    ({"ps_addr": "ps0:29500", "num_trainers": "2"}, "--num-trainers 2 disagrees with torchrun's WORLD_SIZE 4"),
])
def test_a_trainer_under_torchrun_refuses_what_contradicts_it(flags, says):
    with pytest.raises(ConfigError, match=says):
        as_trainer(flags, TORCHRUN)
