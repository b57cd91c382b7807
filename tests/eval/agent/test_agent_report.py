"""The agent report's views (confkv.eval.agent.report), on records written by hand."""

from confkv.eval.agent.report import agent_markdown, lost_values, teacher_forced_views, value_recall


def _record(policy, compression, task, template, steps):
    return {"protocol": "teacher-forced", "policy": policy, "compression": compression, "task": task,
            "template": template, "steps": [{"expert": e, "predicted": p, "raw": raw} for e, p, raw in steps]}


FULL = _record("full", 1.0, "promo-0", "promo", [
    ("click [3]", "click [3]", "click [3]"),
    ('type [7] "SAVE-KCMC"', 'type [7] "SAVE-KCMC"', 'type [7] "SAVE-KCMC"'),
    ('type [8] "Gorvane"', 'type [9] "gorvane"', 'type [9] "gorvane"'),
    ("stop", "scroll down", "scroll down"),
])
LOSSY = _record("h2o", 2.8, "promo-0", "promo", [
    ("click [3]", "click [3]", "click [3]"),
    ('type [7] "SAVE-KCMC"', 'type [7] "SAVE-XXXX"', 'type [7] "SAVE-XXXX"'),
    ('type [8] "Gorvane"', "invalid", "Gorvane is the name"),
    ("stop", "stop", "stop"),
])


def test_value_recall_counts_typed_values_found_in_the_generated_text():
    # full: SAVE-KCMC found, gorvane found (case-insensitive) -> 2 of 2; lossy: only Gorvane -> 1 of 2
    assert value_recall(FULL) == 1.0 and value_recall(LOSSY) == 0.5
    assert value_recall(_record("full", 1.0, "t", "x", [("click [1]", "click [1]", "click [1]")])) is None


def test_views_pair_each_policy_with_full_on_the_same_task():
    views = teacher_forced_views([FULL, LOSSY])
    assert views["templates"] == ["promo"]
    full_row, lossy_row = views["rows"]
    assert full_row["policy"] == "full" and full_row["by_template"] == {"promo": 1.0}
    # predictions equal to full's: step 0 only (step 3: stop vs scroll down) -> 1/4
    assert lossy_row["by_template"] == {"promo": 0.25}
    assert lossy_row["value_recall"] == 0.5 and lossy_row["value_recall_vs_full"] == 0.5


def test_markdown_has_the_command_and_one_line_per_policy():
    summary = [{"protocol": "teacher-forced", "policy": "h2o", "compression": 2.8, "tasks": 1, "agree_expert": 0.5,
                "agree_expert_vs_full": 0.5, "agree_full": 0.25, "peak_kv_bytes": 2e6, "peak_vs_full": 2.8,
                "mean_kv_bytes": 1e6}]
    md = agent_markdown(summary, [FULL, LOSSY], command="confkv agent --x")
    assert "confkv agent --x" in md
    assert "| teacher-forced | h2o | 2.8 | 1 | 0.500 | 0.50 | 0.250 | - | - | 2.0 | 2.80 | 1.0 |" in md
    assert "| h2o x2.8 | 0.25 | 0.50 | 0.50 |" in md and "| full | 1.00 | 1.00 | 1.00 |" in md


def test_lost_values_are_those_full_typed_and_the_policy_did_not():
    lost = lost_values([FULL, LOSSY])
    # SAVE-KCMC: full typed it, h2o typed SAVE-XXXX -> lost; Gorvane: both have it -> not lost
    assert lost == [{"policy": "h2o", "compression": 2.8, "task": "promo-0", "step": 1, "value": "SAVE-KCMC",
                     "typed": 'type [7] "SAVE-XXXX"'}]
    missed_by_full = _record("full", 1.0, "promo-0", "promo", [("click [3]", "click [3]", "click [3]"),
                                                                ('type [7] "SAVE-KCMC"', "scroll down", "scroll down")])
    assert lost_values([missed_by_full, LOSSY]) == []  # full never typed it: nothing the policy lost
    md = agent_markdown([], [FULL, LOSSY])
    assert '| h2o x2.8 | promo-0 | 1 | SAVE-KCMC | type [7] "SAVE-XXXX" |' in md
