"""The benchmarks on a tiny model, so that they keep running: bench/gpu_memory.py on the CPU (the same stage scripts
the 7B table runs, on real ScienceWorld), and the rollout and critic speed benchmarks' own checks."""
import re

from conftest import run_script


def test_stage_memory_table_on_cpu(tmp_path):
    out = run_script("bench/gpu_memory.py", "--shape", "tiny", "--tokens", "512", "--num-envs", "2",
                     "--max-steps", "2", "--workdir", str(tmp_path)).stdout
    rows = dict(re.findall(r"^\| (bc|collect|critic|bppo) \| ([0-9.]+) GB \|", out, re.M))
    assert sorted(rows) == ["bc", "bppo", "collect", "critic"], out
    assert all(float(v) > 0.1 for v in rows.values())  # a Python process with torch holds some 100s of MB
    assert re.search(r"trajectories of (4[6-9][0-9]|50[0-9]|51[0-2]) tokens", out), out  # as long as asked
    assert (tmp_path / "bppo" / "policy").is_dir() and (tmp_path / "critic" / "heads.safetensors").exists()


def test_rollout_benchmark_plays_the_same_episodes_every_way(tiny_policy, tmp_path):
    out = run_script("bench/rollout_speed.py", "--policy", str(tiny_policy), "--env", "webshop", "--num-envs", "2",
                     "--num-tasks", "3", "--max-steps", "2", "--max-new-tokens", "8", "--workdir", str(tmp_path)).stdout
    assert re.search(r"ratio [0-9.]+x \(env steps/s, engine vs ETO's loop\); identical episodes: 3/3", out), out
    assert "3 episodes of webshop (all tasks), step cap 2, 6 env steps" in out, out
    assert len(re.findall(r"^\| (ETO's loop|engine|generate's)", out, re.M)) == 4, out


def test_critic_benchmark_gets_the_same_losses_both_ways():
    out = run_script("bench/critic_speed.py", "--model", "tiny", "--num-trajs", "2").stdout
    assert re.search(r"speed-up: [0-9.]+x \(the same loss after each of 2 updates", out), out


def test_bppo_memory_benchmark_measures_both_ways():
    out = run_script("bench/bppo_memory.py", "--model", "tiny", "--tokens", "256", "--num-trajs", "2").stdout
    figures = [float(x) for x in re.findall(r"([0-9]+) MB", out)]
    assert len(figures) == 4 and all(x > 0 for x in figures), out  # above imports and total, for both ways
    assert re.search(r"shared / separate: [0-9.]+x", out), out
