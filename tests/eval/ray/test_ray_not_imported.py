"""Without ``--ray`` a grid command never imports Ray (issue 16); runs whether or not Ray is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_without_ray_flag_ray_is_not_imported(tmp_path):
    code = ("import sys\nfrom confkv.cli import main\n"
            f"rc = main(['niah', '--model', 'tiny-llama', '--lengths', '120', '--depths', '0', '--policies', 'window',"
            f" '--protocols', 'streaming', '--chunk', '64', '--max-new-tokens', '2', '--no-progress',"
            f" '--out-dir', {str(tmp_path / 'niah')!r}])\n"
            "print(rc, 'ray' in sys.modules)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[3], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0 False"


def test_speedup_report_states_the_machine_ceiling_from_the_records():
    """Two sequences side by side that each take 20% longer cap any 2-way split at 2 / 1.2 = 1.67x."""
    from confkv.eval.ray.speedup import contention_lines

    result = {"busy_seconds_in_process": 100.0, "busy_seconds_ray": 120.0, "wall_ratio": 1.5,
              "wall_seconds_in_process": 110.0, "wall_seconds_ray": 73.3, "wall_seconds_two_processes": 66.0}
    text = " ".join(contention_lines(result, 2))
    assert "+20% slower" in text and "beat 1.67x" in text and "90% of that" in text
    assert "66.0 s, 1.67x the in-process wall time" in text and "1.11x that" in text
