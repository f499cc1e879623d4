"""bench/gpu_memory.py on the CPU: the same stage scripts the 7B table runs, on a tiny model and real ScienceWorld."""
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
