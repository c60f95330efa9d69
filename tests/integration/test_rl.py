"""The RL workload with real processes, RPC and HTTP: the agent and its observers play episodes,
learn, lose and gain observers, take checkpoints and resume; one run learns on real CartPole."""
import os
import shutil
import signal
import subprocess

import pytest
import torch

from services.checkpoint.store import CheckpointStore
from services.client import SidecarError
from tests.support.upcli import run_to_done
from tests.support.wait import wait_until


def run_up(tmp_path, *args, timeout=240):
    return run_to_done(tmp_path, "--workload", "rl", "--progress-interval", "1", *args, timeout=timeout)


def status(role):
    with role.client(timeout=5) as c:
        return c.status()


def agent_and_observers(procs, count, **agent_flags):
    agent = procs.start_rl("agent", "agent", **agent_flags)
    observers = [procs.start_rl("observer", f"observer{i}", env=agent_flags.get("env", "CartPole-v1"))
                 for i in range(count)]
    for r in (agent, *observers):
        procs.wait_ready(r)
    return agent, observers


def test_episodes_over_http_change_the_policy_and_checkpoint_resumes_it(procs, tmp_path):
    agent, observers = agent_and_observers(procs, 2, env="fixed:30", min_observers=2)
    with agent.client(timeout=10) as c, observers[0].client(timeout=30) as o:
        with pytest.raises(SidecarError) as bad:
            c.start_episode(steps=5)                             # the agent counts episodes
        assert bad.value.status == 400
        assert c.start_episode(episodes=3)["episodes"] == 3
        with pytest.raises(SidecarError) as busy:
            c.start_episode(episodes=1)
        assert busy.value.status == 409
        wait_until(lambda: (c.status().get("batch") or {}).get("finished"), 60, "3 episodes")
        s = c.status()
        assert s["episode"] == 3 and s["observers"] == ["observer0", "observer1"] and s["last_reward"] == 30.0
        assert s["env_steps"] == 3 * 2 * 30 and [h["episode"] for h in s["history"]] == [1, 2, 3]
        first = o.checkpoint()                                   # an observer's sidecar asks the agent
        assert first["step"] == 3 and first["files"] == ["agent.pt"]

        c.start_episode()                                        # until solved, or stopped
        wait_until(lambda: c.status()["episode"] >= 6, 60, "more episodes")
        stopped = c.stop_episode()
        assert stopped["stopping"]
        wait_until(lambda: (c.status().get("batch") or {}).get("finished"), 30, "the stop")
        with pytest.raises(SidecarError) as idle:
            c.stop_episode()
        assert idle.value.status == 409
        second = c.checkpoint()
        listing = [x["step"] for x in c.checkpoints()["checkpoints"]]
        assert listing[:2] == [second["step"], first["step"]] and second["step"] > first["step"]
        metrics = c.metrics()
        assert "rpcps_rl_running_reward" in metrics and 'rpcps_episodes_total{name="agent",role="agent"}' in metrics

    store = CheckpointStore(tmp_path / "ckpt")
    a = store.load_file(store.resolve(first["id"]), "agent.pt")
    b = store.load_file(store.resolve(second["id"]), "agent.pt")
    assert any(not torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])   # it learned

    # A new agent (same folder) resumes from the newest checkpoint: episodes and running reward go on.
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(15) == 0
    again = procs.start_rl("agent", "agent", env="fixed:30")
    procs.wait_ready(again, 60)
    with again.client(timeout=10) as c:
        s = c.status()
        assert s["resumed_from"]["id"] == second["id"] and s["episode"] == second["step"]
        assert s["running_reward"] == pytest.approx(b["running_reward"])


def test_an_observer_killed_mid_episode_and_one_joining_later(procs):
    # Long episodes, so the kill lands inside one.
    agent, observers = agent_and_observers(procs, 2, env="fixed:3000", min_observers=2)
    with agent.client(timeout=10) as c:
        c.start_episode()
        wait_until(lambda: status(observers[1]).get("state") == "running", 30, "observer1 inside an episode")
        os.kill(observers[1].proc.pid, signal.SIGKILL)
        observers[1].proc.wait(10)
        wait_until(lambda: c.status().get("observers_lost", 0) >= 1, 30, "the loss to be noticed")
        wait_until(lambda: c.status().get("episode", 0) >= 2, 60, "episodes without observer1")
        s = c.status()
        assert "observer1" not in s["members"] and s["observers"] == ["observer0"]
        assert s["last_lost"] is None or s["last_lost"] == ["observer1"]
        assert any(h["lost"] == ["observer1"] for h in s["history"])
        assert "rpcps_rl_observers_lost_total" in c.metrics()

        late = procs.start_rl("observer", "observer2", env="fixed:3000")
        procs.wait_ready(late)
        wait_until(lambda: "observer2" in (c.status().get("observers") or []), 60, "observer2 taking part")
        c.stop_episode()
    assert "lost observer1 in the middle of an episode" in agent.log_text()


def test_batched_and_seed_modes_play_the_same_episodes(tmp_path):
    common = ["--observers", "2", "--episodes", "6", "--seed", "3", "--no-resume"]
    batched, done_b = run_up(tmp_path / "batched", *common)
    seed, done_s = run_up(tmp_path / "seed", *common, "--no-batched")
    rewards = lambda up: [(e["episode"], e["reward"]) for e in up.events if e["event"] == "progress"]
    assert rewards(batched) == rewards(seed) and len(rewards(batched)) == 6
    assert done_b["running_reward"] == done_s["running_reward"] and not done_b["solved"]


def test_real_cartpole_running_reward_improves(tmp_path):
    up, done = run_up(tmp_path, "--observers", "2", "--episodes", "80", "--seed", "1", timeout=400)
    rewards = [e["reward"] for e in up.events if e["event"] == "progress"]
    assert len(rewards) == 80 and done["episodes"] == 80
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first, (first, last)
    assert (tmp_path / "ckpt" / "step-80" / "manifest.json").exists()    # the final checkpoint


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_rl_metrics_pass_promtool(procs):
    agent, observers = agent_and_observers(procs, 1, env="fixed:5")
    with agent.client(timeout=10) as c:
        c.start_episode(episodes=2)
        wait_until(lambda: (c.status().get("batch") or {}).get("finished"), 60, "2 episodes")
        for role in (agent, observers[0]):
            with role.client(timeout=10) as rc:
                text = rc.metrics()
            r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
