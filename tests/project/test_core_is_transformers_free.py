import subprocess
import sys

CORE = ["confkv", "confkv.config", "confkv.confidence", "confkv.budget", "confkv.policies", "confkv.store.hot_tier",
        "confkv.store", "confkv.quant", "confkv.attention", "confkv.tiers.planner"]


def test_core_modules_do_not_import_transformers():
    code = "import sys\n" + "".join(f"import {m}\n" for m in CORE) + "print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
