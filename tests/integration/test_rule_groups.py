"""promtool unit tests evaluate rule groups in a fixed order: each group after the groups it
reads (tests/fixtures/rule_groups.py says why)."""

from __future__ import annotations

import pytest
import yaml

from tests.fixtures.paths import RULES
from tests.fixtures.rule_groups import eval_order, group_reads, groups_of

TEST_FILES = sorted((RULES / "tests").glob("*.test.yml"))


def load(path):
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_cases_fix_the_order_of_groups(test_file):
    """promtool evaluates the groups of a unit test in a random order unless the file gives
    group_eval_order: an alert evaluated before the group it reads sees a value one step
    old, and the case passes or fails by chance (a CI run failed so)."""
    spec = load(test_file)
    groups = groups_of([test_file.parent / f for f in spec["rule_files"]])
    if len(groups) < 2:
        return
    order = spec.get("group_eval_order")
    assert order, f"{test_file.name}: {len(groups)} rule groups and no group_eval_order"
    assert sorted(order) == sorted(g["name"] for g in groups), f"{test_file.name}: group_eval_order must name every group once"
    for group, needs in group_reads(groups).items():
        for need in needs:
            assert order.index(need) < order.index(group), f"{test_file.name}: {group} reads {need}, which group_eval_order puts after it"


def test_group_reads_sees_records_and_alerts():
    groups = [
        {"name": "a", "rules": [{"record": "x:y:z", "expr": "up"}]},
        {"name": "b", "rules": [{"alert": "B", "expr": "x:y:z > 0"}]},
        {"name": "c", "rules": [{"alert": "C", "expr": 'ALERTS{alertname="B"}'}]},
    ]
    assert group_reads(groups) == {"a": set(), "b": {"a"}, "c": {"b"}}


def test_eval_order_puts_what_is_read_first(tmp_path):
    path = tmp_path / "r.rules.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {"name": "alerts", "rules": [{"alert": "A", "expr": "r:x:y > 0"}]},
                    {"name": "after", "rules": [{"alert": "B", "expr": 'ALERTS{alertname="A"}'}]},
                    {"name": "records", "rules": [{"record": "r:x:y", "expr": "up"}]},
                ]
            }
        )
    )
    assert eval_order([path]) == ["records", "alerts", "after"]
