from confkv.cli import main
from confkv.policies import POLICIES


def test_policies_lists_every_policy_with_flat_parameters(capsys):
    assert main(["policies"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(lines) == set(POLICIES)
    assert "tau=0.5" in lines["confkv"] and "n_high=256" in lines["confkv"] and "gate=" not in lines["confkv"]
    assert "budget=512" in lines["window"]
