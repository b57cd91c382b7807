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
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0 False"
